// The CUDA model (inference_rank/model/cuda_model.h) against the CPU reference model on
// identical weights, for every family and every head_dim / GQA group the kernels support:
// prefill in chunks, rewinds, decode, attention windows; batched decode (and mixed decode +
// prefill batches) equal to each sequence alone; CUDA-graph replay equal to eager bit for bit;
// capacity errors that leave the other sequences untouched; sampling on the device; errors.
// Golden (transformers) parity and the engine are in cuda_model_golden_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/model/tiny_test_models.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

struct ShapeCase {
  const char* name;
  std::string json;
};

std::vector<ShapeCase> ShapeCases() {
  return {
      {"tiny_qwen3_hd16", TinyConfigJson(TinyModelKind::kQwen3)},
      {"tiny_qwen2_hd16_qkv_bias", TinyConfigJson(TinyModelKind::kQwen2)},
      {"tiny_llama3_hd16_biases", TinyConfigJson(TinyModelKind::kLlama)},
      {"qwen3_hd32_group1", SmallConfigJson("Qwen3ForCausalLM", 128, 4, 4, 32, 256, 2, 300, true)},
      {"qwen2_hd64_group2", SmallConfigJson("Qwen2ForCausalLM", 256, 4, 2, 64, 512, 2, 777, false)},
      {"qwen3_hd128_group4",
       SmallConfigJson("Qwen3ForCausalLM", 256, 8, 2, 128, 512, 2, 1000, false)},
      {"llama_hd64_group8", SmallConfigJson("LlamaForCausalLM", 512, 8, 1, 64, 512, 2, 515, false,
                                            ", \"attention_bias\": true")},
  };
}

std::string Qwen3Hd128() { return ShapeCases()[5].json; }
std::string LlamaHd64() { return ShapeCases()[6].json; }

TokenSampling Greedy() { return TokenSampling{}; }

// ---- CPU vs CUDA on identical weights -----------------------------------------------------------

// Prefill `prompt_len` random tokens in chunks of 37, rewind to position prompt_len - 31 and
// feed the same tokens again, then decode `decode_steps` tokens (the CPU's greedy choice fed to
// both), comparing every row of logits.
void ExpectCudaMatchesCpu(const std::string& name, const std::string& json, int block_tokens,
                          int prompt_len, int chunk, int decode_steps,
                          const AttentionWindow& window = AttentionWindow()) {
  ModelPair pair = MakeModelPair(json, /*seed=*/11);
  ASSERT_TRUE(pair.cpu && pair.cuda);
  const int vocab = pair.cpu->config().vocab_size;
  std::mt19937_64 rng = gpu_test::FreshRng();
  const std::vector<int> prompt = RandomTokens(rng, prompt_len, vocab);
  const int blocks = (prompt_len + decode_steps) / block_tokens + 2;
  auto cpu_cache = NewCache(*pair.cpu, block_tokens, blocks);
  auto cuda_cache = NewCache(*pair.cuda, block_tokens, blocks);
  ASSERT_TRUE(cpu_cache && cuda_cache);
  KvSequence cpu_seq, cuda_seq;

  const std::vector<float> cpu_prefill =
      FeedAll(*pair.cpu, *cpu_cache, cpu_seq, prompt, 0, chunk, window);
  const std::vector<float> cuda_prefill =
      FeedAll(*pair.cuda, *cuda_cache, cuda_seq, prompt, 0, chunk, window);
  ExpectRowsClose(name + " prefill", cuda_prefill, cpu_prefill, vocab);
  EXPECT_EQ(cuda_seq.num_tokens, prompt_len);
  EXPECT_EQ(cuda_seq.block_table, cpu_seq.block_table);

  // Rewind: the last 31 positions again, overwriting their KV with the same values.
  const int rewind = std::max(0, prompt_len - 31);
  const auto tail = std::span<const int>(prompt).subspan(static_cast<size_t>(rewind));
  const std::vector<float> cpu_again =
      FeedAll(*pair.cpu, *cpu_cache, cpu_seq, tail, rewind, 16, window);
  const std::vector<float> cuda_again =
      FeedAll(*pair.cuda, *cuda_cache, cuda_seq, tail, rewind, 16, window);
  ExpectRowsClose(name + " rewind", cuda_again, cpu_again, vocab);

  int token = ArgMax(std::span<const float>(cpu_prefill).last(static_cast<size_t>(vocab)));
  ForwardResult cpu_result, cuda_result;
  const TokenSampling greedy = Greedy();
  for (int step = 0; step < decode_steps; ++step) {
    const int position = prompt_len + step;
    ForwardEntry cpu_entry{&cpu_seq, {&token, 1}, position, LogitsWanted::kAll};
    ForwardEntry cuda_entry{&cuda_seq, {&token, 1}, position, LogitsWanted::kAll, &greedy};
    ASSERT_STATUS_OK(pair.cpu->Forward({&cpu_entry, 1}, *cpu_cache, cpu_result, window));
    ASSERT_STATUS_OK(pair.cuda->Forward({&cuda_entry, 1}, *cuda_cache, cuda_result, window));
    ExpectRowsClose(name + " decode step " + std::to_string(step), cuda_result.LastLogits(0),
                    cpu_result.LastLogits(0), vocab);
    EXPECT_EQ(cuda_result.sampled_tokens[0], ArgMax(cuda_result.LastLogits(0)))
        << "greedy sampling on the device must pick the argmax of the returned logits";
    token = ArgMax(cpu_result.LastLogits(0));
  }
}

struct CpuVsCudaParam {
  ShapeCase shape;
  int block_tokens;
};

void PrintTo(const CpuVsCudaParam& p, std::ostream* os) {
  *os << p.shape.name << ", block " << p.block_tokens;
}

class CudaVsCpuTest : public ::testing::TestWithParam<CpuVsCudaParam> {};

TEST_P(CudaVsCpuTest, PrefillChunksRewindAndDecode) {
  const CpuVsCudaParam& p = GetParam();
  ExpectCudaMatchesCpu(p.shape.name, p.shape.json, p.block_tokens, /*prompt_len=*/131,
                       /*chunk=*/37, /*decode_steps=*/12);
}

std::vector<CpuVsCudaParam> CpuVsCudaParams() {
  std::vector<CpuVsCudaParam> params;
  for (const ShapeCase& shape : ShapeCases()) {
    for (int block_tokens : {16, 64}) params.push_back({shape, block_tokens});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVsCpuTest, ::testing::ValuesIn(CpuVsCudaParams()),
                         [](const auto& info) {
                           return std::string(info.param.shape.name) + "_block" +
                                  std::to_string(info.param.block_tokens);
                         });

TEST(CudaVsCpuWindowTest, StreamingWindowMatchesCpu) {
  AttentionWindow window;
  window.sink_tokens = 4;
  window.recent_tokens = 40;
  ExpectCudaMatchesCpu("qwen3_hd128 sink 4 recent 40", Qwen3Hd128(), 16, 131, 37, 6, window);
  ExpectCudaMatchesCpu("llama_hd64 sink 4 recent 40", LlamaHd64(), 64, 131, 37, 6, window);
}

TEST(CudaVsCpuLargeTest, LongPromptsMatchCpu) {
  ExpectCudaMatchesCpu("qwen3_hd128 4099", Qwen3Hd128(), 64, 4099, 1000, 4);
  ExpectCudaMatchesCpu("llama_hd64 4099", LlamaHd64(), 16, 4099, 1000, 4);
  ExpectCudaMatchesCpu("tiny_qwen3 65537", ShapeCases()[0].json, 64, 65537, 8192, 3);
}

// ---- batching -----------------------------------------------------------------------------------

// Sequences of the given lengths prefilled alone into two caches of one CUDA model; then
// `steps` decode steps of all of them in one batch in the first cache and each alone in the
// second, the same tokens fed to both.
void ExpectBatchedDecodeEqualsAlone(const std::vector<int>& lengths, int steps) {
  ModelPair pair = MakeModelPair(Qwen3Hd128(), /*seed=*/5);
  ASSERT_TRUE(pair.cuda);
  CudaModel& model = *pair.cuda;
  const int vocab = model.config().vocab_size;
  const size_t n = lengths.size();
  int blocks = 0;
  for (int length : lengths) blocks += (length + steps) / 64 + 1;
  auto batched_cache = NewCache(model, 64, blocks);
  auto alone_cache = NewCache(model, 64, blocks);
  ASSERT_TRUE(batched_cache && alone_cache);
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<KvSequence> batched(n), alone(n);
  std::vector<int> next(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<int> prompt = RandomTokens(rng, lengths[i], vocab);
    FeedAll(model, *batched_cache, batched[i], prompt, 0, 512);
    const std::vector<float> logits = FeedAll(model, *alone_cache, alone[i], prompt, 0, 512);
    next[i] = ArgMax(std::span<const float>(logits).last(static_cast<size_t>(vocab)));
  }
  const TokenSampling greedy = Greedy();
  ForwardResult batched_result, alone_result;
  for (int step = 0; step < steps; ++step) {
    std::vector<ForwardEntry> batch;
    for (size_t i = 0; i < n; ++i) {
      batch.push_back(
          {&batched[i], {&next[i], 1}, batched[i].num_tokens, LogitsWanted::kAll, &greedy});
    }
    ASSERT_STATUS_OK(model.Forward(batch, *batched_cache, batched_result));
    for (size_t i = 0; i < n; ++i) {
      ForwardEntry entry{
          &alone[i], {&next[i], 1}, alone[i].num_tokens, LogitsWanted::kAll, &greedy};
      ASSERT_STATUS_OK(model.Forward({&entry, 1}, *alone_cache, alone_result));
      const std::string what = "sequence " + std::to_string(i) + " (length " +
                               std::to_string(lengths[i]) + ") step " + std::to_string(step);
      ExpectRowsClose(what, batched_result.EntryLogits(static_cast<int>(i)),
                      alone_result.EntryLogits(0), vocab);
      EXPECT_EQ(batched_result.sampled_tokens[i],
                ArgMax(batched_result.EntryLogits(static_cast<int>(i))));
      EXPECT_EQ(batched[i].num_tokens, alone[i].num_tokens);
      next[i] = alone_result.sampled_tokens[0];
    }
  }
}

TEST(CudaModelBatchTest, BatchedDecodeOf3EqualsAlone) {
  ExpectBatchedDecodeEqualsAlone({1, 127, 54}, 4);
}

TEST(CudaModelBatchTest, BatchedDecodeOf17EqualsAlone) {
  std::vector<int> lengths;
  for (int i = 0; i < 17; ++i) lengths.push_back(1 + (i * 53) % 300);
  ExpectBatchedDecodeEqualsAlone(lengths, 3);
}

TEST(CudaModelBatchLargeTest, BatchedDecodeOf17LongSequencesEqualsAlone) {
  std::vector<int> lengths = {1, 127, 4099};
  for (int i = 3; i < 17; ++i) lengths.push_back(1 + (i * 241) % 4099);
  ExpectBatchedDecodeEqualsAlone(lengths, 3);
}

// One batch mixing prefill chunks (new and continuing sequences) with decode tokens, in an
// order that is not the model's row order, equals each entry alone; and the KV it wrote is the
// same (a following decode step of all four agrees too).
TEST(CudaModelBatchTest, MixedDecodeAndPrefillBatchEqualsAlone) {
  ModelPair pair = MakeModelPair(LlamaHd64(), /*seed=*/8);
  ASSERT_TRUE(pair.cuda);
  CudaModel& model = *pair.cuda;
  const int vocab = model.config().vocab_size;
  auto batched_cache = NewCache(model, 16, 64);
  auto alone_cache = NewCache(model, 16, 64);
  ASSERT_TRUE(batched_cache && alone_cache);
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int prefilled[4] = {40, 90, 0, 10};  // A, B, C (new), D
  std::vector<KvSequence> batched(4), alone(4);
  for (int i = 0; i < 4; ++i) {
    if (prefilled[i] == 0) continue;
    const std::vector<int> prompt = RandomTokens(rng, prefilled[i], vocab);
    FeedAll(model, *batched_cache, batched[size_t(i)], prompt, 0, 64);
    FeedAll(model, *alone_cache, alone[size_t(i)], prompt, 0, 64);
  }
  const std::vector<int> chunk_c = RandomTokens(rng, 30, vocab);
  const std::vector<int> chunk_d = RandomTokens(rng, 20, vocab);
  const int token_a = 3, token_b = 4;
  const TokenSampling greedy = Greedy();
  auto entries = [&](std::vector<KvSequence>& s, LogitsWanted d_logits) {
    return std::vector<ForwardEntry>{
        {&s[2], chunk_c, 0, LogitsWanted::kAll},                  // C: new prompt, all rows
        {&s[0], {&token_a, 1}, 40, LogitsWanted::kAll, &greedy},  // A: decode
        {&s[3], chunk_d, 10, d_logits, &greedy},                  // D: continuing chunk
        {&s[1], {&token_b, 1}, 90, LogitsWanted::kLast},          // B: decode, host logits
    };
  };
  ForwardResult batched_result, alone_result;
  const std::vector<ForwardEntry> batch = entries(batched, LogitsWanted::kLast);
  ASSERT_STATUS_OK(model.Forward(batch, *batched_cache, batched_result));
  EXPECT_EQ(batched_result.entry_row_count, (std::vector<int>{30, 1, 0, 1}))
      << "a sampled kLast entry leaves its logits on the device";
  EXPECT_EQ(batched_result.sampled_tokens[0], -1);
  EXPECT_EQ(batched_result.sampled_tokens[3], -1);
  const std::vector<ForwardEntry> singles = entries(alone, LogitsWanted::kAll);
  for (int e = 0; e < 4; ++e) {
    ASSERT_STATUS_OK(model.Forward({&singles[size_t(e)], 1}, *alone_cache, alone_result));
    const std::string what = "mixed batch entry " + std::to_string(e);
    if (e == 2) {  // D: only its sampled token came back from the batch
      const auto last = alone_result.LastLogits(0);
      if (Top2Margin(last) > 0.1 * Rms(last)) {
        EXPECT_EQ(batched_result.sampled_tokens[2], ArgMax(last)) << what;
      }
      EXPECT_EQ(alone_result.sampled_tokens[0], ArgMax(last)) << what;
      continue;
    }
    ExpectRowsClose(what, batched_result.EntryLogits(e), alone_result.EntryLogits(0), vocab);
  }
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(batched[size_t(i)].num_tokens, alone[size_t(i)].num_tokens) << "sequence " << i;
  }
  // The KV the mixed batch wrote: one more decode step of everything, batched vs alone.
  std::vector<int> next = {5, 6, 7, 8};
  std::vector<ForwardEntry> step;
  for (int i = 0; i < 4; ++i) {
    step.push_back({&batched[size_t(i)],
                    {&next[size_t(i)], 1},
                    batched[size_t(i)].num_tokens,
                    LogitsWanted::kLast});
  }
  ASSERT_STATUS_OK(model.Forward(step, *batched_cache, batched_result));
  for (int i = 0; i < 4; ++i) {
    ForwardEntry entry{
        &alone[size_t(i)], {&next[size_t(i)], 1}, alone[size_t(i)].num_tokens, LogitsWanted::kLast};
    ASSERT_STATUS_OK(model.Forward({&entry, 1}, *alone_cache, alone_result));
    ExpectRowsClose("after the mixed batch, sequence " + std::to_string(i),
                    batched_result.LastLogits(i), alone_result.LastLogits(0), vocab);
  }
}

// ---- CUDA graphs --------------------------------------------------------------------------------

bool BitwiseEqual(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// Two CUDA models with the same weights, one replaying decode steps as graphs, one always eager,
// decode the same sequences: every logit and token must be identical. `lengths` sequences are
// prefilled first; the batch then shrinks to its first two sequences and samples with a
// temperature (a new graph key; tokens only). `greedy_keys`: graph keys the greedy steps go
// through (a new decode bucket is a new key).
void ExpectGraphEqualsEager(const std::string& json, const std::vector<int>& lengths, int steps,
                            int block_tokens, int blocks, int greedy_keys = 1) {
  Result<ModelConfig> config = ParseModelConfig(json, "test config.json");
  ASSERT_STATUS_OK(config.status());
  Result<ModelWeights> weights = RandomWeights(*config, 21);
  ASSERT_STATUS_OK(weights.status());
  CudaModelOptions graph_options, eager_options;
  eager_options.use_cuda_graph = false;
  auto graph = CudaModel::Create(*config, *weights, graph_options);
  auto eager = CudaModel::Create(*config, *weights, eager_options);
  ASSERT_STATUS_OK(graph.status());
  ASSERT_STATUS_OK(eager.status());
  auto graph_cache = NewCache(**graph, block_tokens, blocks);
  auto eager_cache = NewCache(**eager, block_tokens, blocks);
  ASSERT_TRUE(graph_cache && eager_cache);
  const int vocab = config->vocab_size;
  std::mt19937_64 rng = gpu_test::FreshRng();
  const size_t n = lengths.size();
  std::vector<KvSequence> g(n), e(n);
  std::vector<int> next(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<int> prompt = RandomTokens(rng, lengths[i], vocab);
    const auto a = FeedAll(**graph, *graph_cache, g[i], prompt, 0, 1024);
    const auto b = FeedAll(**eager, *eager_cache, e[i], prompt, 0, 1024);
    ASSERT_TRUE(BitwiseEqual(a, b)) << "prefill of sequence " << i;
    next[i] = ArgMax(std::span<const float>(a).last(static_cast<size_t>(vocab)));
  }
  const TokenSampling greedy = Greedy();
  ForwardResult gr, er;
  auto run = [&](size_t count, LogitsWanted logits, const TokenSampling* sampling) {
    std::vector<ForwardEntry> gb, eb;
    for (size_t i = 0; i < count; ++i) {
      gb.push_back({&g[i], {&next[i], 1}, g[i].num_tokens, logits, sampling});
      eb.push_back({&e[i], {&next[i], 1}, e[i].num_tokens, logits, sampling});
    }
    ASSERT_STATUS_OK((*graph)->Forward(gb, *graph_cache, gr));
    ASSERT_STATUS_OK((*eager)->Forward(eb, *eager_cache, er));
    ASSERT_TRUE(BitwiseEqual(gr.logits, er.logits)) << "logits differ between graph and eager";
    ASSERT_EQ(gr.sampled_tokens, er.sampled_tokens);
    for (size_t i = 0; i < count; ++i) next[i] = gr.sampled_tokens[i];
  };
  for (int step = 0; step < steps; ++step) run(n, LogitsWanted::kAll, &greedy);
  TokenSampling hot;
  hot.temperature = 0.8f;
  hot.top_p = 0.95f;
  for (int step = 0; step < 4; ++step) {
    hot.uniform = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    run(std::min<size_t>(2, n), LogitsWanted::kLast, &hot);
  }
  // First sight of a key runs eagerly, the second captures: all but one step per key replay.
  EXPECT_GE((*graph)->graph_replays(), steps - greedy_keys + 3)
      << "decode steps did not replay graphs";
  EXPECT_EQ((*eager)->graph_replays(), 0);
  std::printf("[ graphs    ] %lld captured, %lld launched\n",
              static_cast<long long>((*graph)->graph_captures()),
              static_cast<long long>((*graph)->graph_replays()));
}

TEST(CudaModelGraphTest, GraphReplayEqualsEagerBitwise) {
  ExpectGraphEqualsEager(LlamaHd64(), {5, 40, 77}, 12, 16, 64);
  ExpectGraphEqualsEager(Qwen3Hd128(), {1, 130}, 8, 64, 16);
}

TEST(CudaModelGraphLargeTest, GraphReplayEqualsEagerAcrossBucketBoundary) {
  // 4090 + 10 steps crosses the 4096 bucket: a new graph key mid-decode.
  ExpectGraphEqualsEager(Qwen3Hd128(), {4090, 30, 3000}, 10, 64, 200, /*greedy_keys=*/2);
}

// ---- capacity and errors ------------------------------------------------------------------------

TEST(CudaModelCapacityTest, ForwardThatCannotReserveLeavesOtherSequencesUntouched) {
  ModelPair pair = MakeModelPair(Qwen3Hd128(), /*seed=*/2);
  ASSERT_TRUE(pair.cuda);
  CudaModel& model = *pair.cuda;
  const int vocab = model.config().vocab_size;
  auto cache = NewCache(model, 16, 10);    // 160 positions
  auto control = NewCache(model, 16, 10);  // the same history without the failed forwards
  ASSERT_TRUE(cache && control);
  std::mt19937_64 rng = gpu_test::FreshRng();
  const std::vector<int> prompt = RandomTokens(rng, 100, vocab);  // 7 blocks
  KvSequence a, a_control, b;
  FeedAll(model, *cache, a, prompt, 0, 64);
  FeedAll(model, *control, a_control, prompt, 0, 64);
  const std::vector<int32_t> a_blocks = a.block_table;
  ASSERT_EQ(cache->free_blocks(), 3);

  const std::vector<int> long_chunk = RandomTokens(rng, 60, vocab);  // needs 4 blocks
  ForwardResult result;
  ForwardEntry b_entry{&b, long_chunk, 0, LogitsWanted::kLast};
  Status status = model.Forward({&b_entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status.message();
  std::printf("[ capacity  ] %s\n", status.message().c_str());
  // All or nothing within a batch: A's decode token fits, B's chunk does not.
  const int token = 9;
  std::vector<ForwardEntry> both = {{&a, {&token, 1}, 100, LogitsWanted::kLast}, b_entry};
  status = model.Forward(both, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status.message();
  EXPECT_EQ(cache->free_blocks(), 3);
  EXPECT_TRUE(b.block_table.empty());
  EXPECT_EQ(b.num_tokens, 0);
  EXPECT_EQ(a.block_table, a_blocks);
  EXPECT_EQ(a.num_tokens, 100);

  // A's KV is intact: its next step gives the same bits as in the untouched control cache.
  ForwardEntry a_entry{&a, {&token, 1}, 100, LogitsWanted::kLast};
  ForwardEntry control_entry{&a_control, {&token, 1}, 100, LogitsWanted::kLast};
  ForwardResult control_result;
  ASSERT_STATUS_OK(model.Forward({&a_entry, 1}, *cache, result));
  ASSERT_STATUS_OK(model.Forward({&control_entry, 1}, *control, control_result));
  EXPECT_TRUE(BitwiseEqual(result.logits, control_result.logits));
}

TEST(CudaModelErrorTest, BadInputsAreNamedErrors) {
  ModelPair pair = MakeModelPair(TinyConfigJson(TinyModelKind::kQwen3), /*seed=*/3);
  ASSERT_TRUE(pair.cpu && pair.cuda);
  auto cuda_cache = NewCache(*pair.cuda, 16, 8);
  auto cpu_cache = NewCache(*pair.cpu, 16, 8);
  ASSERT_TRUE(cuda_cache && cpu_cache);
  KvSequence s0, s1;
  const std::vector<int> ok_tokens = {1, 2, 3};
  const std::vector<int> bad_tokens = {1, 97};
  ForwardResult result;

  ForwardEntry entry{&s0, ok_tokens, 0, LogitsWanted::kLast};
  Status status = pair.cuda->Forward({&entry, 1}, *cpu_cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("CUDA model"), std::string::npos) << status.message();

  std::vector<ForwardEntry> batch = {{&s0, ok_tokens, 0, LogitsWanted::kLast},
                                     {&s1, bad_tokens, 0, LogitsWanted::kLast}};
  status = pair.cuda->Forward(batch, *cuda_cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("entry 1"), std::string::npos) << status.message();
  EXPECT_EQ(cuda_cache->free_blocks(), 8) << "nothing reserved on a validation error";

  auto bad_block = pair.cuda->CreateKvCache(17, 8);
  EXPECT_EQ(bad_block.status().code(), StatusCode::kInvalidArgument);
  auto huge = pair.cuda->CreateKvCache(64, 1 << 30);  // terabytes
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(huge.status().message().find("bytes"), std::string::npos) << huge.status().message();
  std::printf("[ errors    ] %s\n", huge.status().message().c_str());

  TestTempDir dir("cuda_model");
  dir.WriteFile("config.json", TinyConfigJson(TinyModelKind::kQwen3));
  CudaModelOptions options;
  options.random_weights = true;
  options.device = 99;
  auto missing = LoadCudaModel(dir.path(), options);
  EXPECT_EQ(missing.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(missing.status().message().find("device 99"), std::string::npos)
      << missing.status().message();
}

// ---- sampling -----------------------------------------------------------------------------------

// Device sampling of 17 rows with assorted filters, penalties and logit_bias equals the host's
// SampleOnHost on the same (raw, kAll) logits, except where the uniform falls within rounding of
// a cumulative-probability boundary. The penalised rows' counts change every step under the same
// captured graph.
TEST(CudaModelSamplingTest, DeviceSamplingMatchesHostOnTheSameLogits) {
  ModelPair pair = MakeModelPair(LlamaHd64(), /*seed=*/17);
  ASSERT_TRUE(pair.cuda);
  CudaModel& model = *pair.cuda;
  const int vocab = model.config().vocab_size;
  auto cache = NewCache(model, 16, 64);
  ASSERT_TRUE(cache);
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<KvSequence> sequences(17);
  std::vector<int> tokens(17);
  for (size_t i = 0; i < 17; ++i) {
    FeedAll(model, *cache, sequences[i], RandomTokens(rng, 1 + int(i) * 3, vocab), 0, 64);
    tokens[i] = static_cast<int>(rng() % static_cast<uint64_t>(vocab));
  }
  std::vector<TokenSampling> sampling(17);
  std::vector<std::vector<int>> generated(17);
  std::vector<std::vector<std::pair<int, float>>> bias(17);
  for (size_t i = 0; i < 17; ++i) {
    if (i % 5 != 2) continue;
    for (int b = 0; b < 6; ++b) {
      bias[i].push_back({int(rng() % uint64_t(vocab)), float(int(rng() % 21) - 10)});
    }
    std::sort(bias[i].begin(), bias[i].end());
    bias[i].erase(std::unique(bias[i].begin(), bias[i].end(),
                              [](auto& a, auto& b) { return a.first == b.first; }),
                  bias[i].end());
  }
  SamplingWorkspace workspace;
  for (int step = 0; step < 5; ++step) {
    std::vector<ForwardEntry> batch;
    for (size_t i = 0; i < 17; ++i) {
      TokenSampling& s = sampling[i];
      s.temperature = i % 4 == 0 ? 0.f : 0.3f + 0.2f * float(i % 5);
      s.top_k = i % 3 == 0 ? 0 : int(1 + i * 7 % 50);
      s.top_p = i % 2 == 0 ? 1.f : 0.5f + 0.05f * float(i % 7);
      s.uniform = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      s.report_probability = i % 2 == 1;
      if (i % 3 == 1) {  // penalties over what the row generated so far (none at step 0)
        s.adjustments.presence_penalty = 1.5f;
        s.adjustments.frequency_penalty = 0.75f;
        s.adjustments.generated = generated[i];
      }
      s.adjustments.logit_bias = bias[i];
      batch.push_back(
          {&sequences[i], {&tokens[i], 1}, sequences[i].num_tokens, LogitsWanted::kAll, &s});
    }
    ForwardResult result;
    ASSERT_STATUS_OK(model.Forward(batch, *cache, result));
    for (size_t i = 0; i < 17; ++i) {
      const auto logits = result.EntryLogits(static_cast<int>(i));
      const int device = result.sampled_tokens[i];
      float host_probability = -1.f;
      const int host = SampleOnHost(logits, sampling[i], workspace, &host_probability);
      if (sampling[i].report_probability && device == host) {
        EXPECT_NEAR(result.sampled_probabilities[i], host_probability,
                    1e-6f + 1e-5f * host_probability)
            << "row " << i << " step " << step;
      }
      if (sampling[i].temperature == 0.f) {
        EXPECT_EQ(device, host) << "greedy row " << i << " step " << step;
      } else if (device != host) {
        // Allowed only at a boundary: the uniform within 1e-5 of the cumulative probability
        // that separates the two candidates (the device keeps probabilities in f32).
        const SamplingFilter filter{sampling[i].temperature, sampling[i].top_k, sampling[i].top_p};
        std::vector<float> adjusted(logits.begin(), logits.end());
        ApplyLogitAdjustments(adjusted, sampling[i].adjustments, workspace);
        FilteredDistribution(adjusted, filter, workspace);
        double total = 0, cumulative = 0, boundary_gap = INFINITY;
        for (double p : workspace.probabilities) total += p;
        for (size_t c = 0; c < workspace.candidates.size(); ++c) {
          cumulative += workspace.probabilities[c] / total;
          boundary_gap = std::min(boundary_gap, std::fabs(cumulative - sampling[i].uniform));
        }
        EXPECT_LT(boundary_gap, 1e-5)
            << "row " << i << " step " << step << ": device " << device << " host " << host;
      }
      tokens[i] = device;
      generated[i].push_back(device);
    }
  }
}

// A greedy kLast row (no logits come back at all) whose logit_bias lifts one token by 100 gets
// that token from the device sampler.
TEST(CudaModelSamplingTest, LogitBiasAndPenaltiesSteerDeviceGreedy) {
  ModelPair pair = MakeModelPair(LlamaHd64(), /*seed=*/23);
  ASSERT_TRUE(pair.cuda);
  CudaModel& model = *pair.cuda;
  const int vocab = model.config().vocab_size;
  auto cache = NewCache(model, 16, 16);
  ASSERT_TRUE(cache);
  std::mt19937_64 rng = gpu_test::FreshRng();
  KvSequence sequence;
  FeedAll(model, *cache, sequence, RandomTokens(rng, 9, vocab), 0, 16);
  const int forced = int(rng() % uint64_t(vocab));
  const std::vector<std::pair<int, float>> bias = {{forced, 100.f}};
  TokenSampling greedy;
  greedy.adjustments.logit_bias = bias;
  const int token = 5;
  ForwardEntry entry{&sequence, {&token, 1}, sequence.num_tokens, LogitsWanted::kLast, &greedy};
  ForwardResult result;
  ASSERT_STATUS_OK(model.Forward({&entry, 1}, *cache, result));
  EXPECT_EQ(result.sampled_tokens[0], forced);
  EXPECT_EQ(result.entry_row_count[0], 0);
}

}  // namespace
}  // namespace rubato
