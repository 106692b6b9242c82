// GpuCacheAttention (inference_rank/residency/offloaded/gpu_cache_attention.h) against local
// dense attention on the model GPU: the same q|k|v rows appended to a local paged cache and
// attended by the same ops must give the very same bf16 output, step after step, for several
// sessions of different lengths, eagerly and replayed from a CUDA graph; the cache GPU is the
// second device when there is one, else the model's own.
#include "inference_rank/residency/offloaded/gpu_cache_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/kv_append.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::FreshRng;
using gpu_test::RandomBf16Values;
using gpu_test::ToBf16;

ModelConfig SmallConfig() {
  ModelConfig config;
  config.num_layers = 3;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  config.head_dim = 128;
  config.hidden_size = 1024;
  return config;
}

// Local dense decode attention of the same rows: a paged cache on the model device.
class LocalAttention {
 public:
  LocalAttention(const ModelConfig& config, int block_tokens, int num_blocks, int max_rows,
                 int max_context)
      : config_(config),
        max_rows_(max_rows),
        table_stride_((max_context + block_tokens - 1) / block_tokens) {
    KvCacheShape shape{config.num_layers, config.num_kv_heads, config.head_dim, block_tokens,
                       num_blocks};
    auto pools = DeviceKvStorage::Create(shape);
    EXPECT_TRUE(pools.ok());
    pools_ = pools->get();
    cache_ = std::move(PagedKvCache::CreateWithStorage(shape, std::move(*pools))).value();
    inputs_ = std::move(cuda::DeviceBuffer<int32_t>::Allocate(
                            static_cast<size_t>(max_rows) * (2 + table_stride_), "inputs"))
                  .value();
    workspace_ = std::move(cuda::DeviceBuffer<unsigned char>::Allocate(
                               cuda::DecodeAttentionWorkspaceBytes(
                                   max_rows, config.num_heads, config.head_dim, max_context, false),
                               "workspace"))
                     .value();
  }
  KvSequence& Open(int capacity) {
    sequences_.emplace_back();
    EXPECT_TRUE(cache_->Reserve(sequences_.back(), capacity).ok());
    return sequences_.back();
  }
  void Plan(const std::vector<GpuCacheAttention::Row>& rows, int decode_rows) {
    const int bt = cache_->shape().block_tokens;
    std::vector<int32_t> host(static_cast<size_t>(max_rows_) * (2 + table_stride_), 0);
    max_seq_len_ = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      const KvSequence& s = sequences_[static_cast<size_t>(rows[r].session)];
      host[r] = s.block_table[rows[r].position / bt] * bt + rows[r].position % bt;
      if (static_cast<int>(r) >= decode_rows) continue;
      host[max_rows_ + r] = rows[r].position + 1;
      max_seq_len_ = std::max(max_seq_len_, rows[r].position + 1);
      for (int b = 0; b < (rows[r].position + bt) / bt; ++b) {
        host[2 * max_rows_ + r * table_stride_ + b] = s.block_table[static_cast<size_t>(b)];
      }
    }
    ASSERT_EQ(cudaSuccess,
              cudaMemcpy(inputs_.data(), host.data(), host.size() * 4, cudaMemcpyHostToDevice));
    rows_ = static_cast<int>(rows.size());
    decode_rows_ = decode_rows;
  }
  void Layer(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* out, cudaStream_t stream) {
    const int q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
    cuda::KvAppendParams append;
    append.keys = qkv + q_dim;
    append.values = qkv + q_dim + kv_dim;
    append.row_stride = q_dim + 2 * kv_dim;
    append.slots = inputs_.data();
    append.tokens = rows_;
    append.num_kv_heads = config_.num_kv_heads;
    append.head_dim = config_.head_dim;
    append.block_tokens = cache_->shape().block_tokens;
    append.key_pool = pools_->layer_keys(layer);
    append.value_pool = pools_->layer_values(layer);
    ASSERT_TRUE(cuda::AppendToPagedKv(append, stream).ok());
    if (decode_rows_ == 0) return;
    cuda::DecodeAttentionParams p;
    p.q = qkv;
    p.q_row_stride = q_dim + 2 * kv_dim;
    p.key_pool = pools_->layer_keys(layer);
    p.value_pool = pools_->layer_values(layer);
    p.num_pool_blocks = cache_->shape().num_blocks;
    p.block_tables = inputs_.data() + 2 * max_rows_;
    p.block_table_stride = table_stride_;
    p.seq_lens = inputs_.data() + max_rows_;
    p.batch = decode_rows_;
    p.num_heads = config_.num_heads;
    p.num_kv_heads = config_.num_kv_heads;
    p.head_dim = config_.head_dim;
    p.block_tokens = cache_->shape().block_tokens;
    p.max_seq_len = max_seq_len_;
    p.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    p.out = out;
    p.out_row_stride = q_dim;
    p.workspace = workspace_.data();
    p.workspace_bytes = workspace_.bytes();
    ASSERT_TRUE(cuda::DecodeAttention(p, stream).ok());
  }

 private:
  ModelConfig config_;
  int max_rows_, table_stride_;
  DeviceKvStorage* pools_ = nullptr;
  std::unique_ptr<PagedKvCache> cache_;
  std::vector<KvSequence> sequences_;
  cuda::DeviceBuffer<int32_t> inputs_;
  cuda::DeviceBuffer<unsigned char> workspace_;
  int rows_ = 0, decode_rows_ = 0, max_seq_len_ = 0;
};

std::vector<uint16_t> Download(const cuda::DeviceBuffer<__nv_bfloat16>& buffer, size_t count) {
  std::vector<uint16_t> host(count);
  EXPECT_EQ(cudaSuccess, cudaMemcpy(host.data(), buffer.data(), count * 2, cudaMemcpyDeviceToHost));
  return host;
}

void RunSteps(int block_tokens, bool use_graph) {
  int devices = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDeviceCount(&devices));
  const ModelConfig config = SmallConfig();
  const int max_rows = 64, max_context = 700, prefill[3] = {5, 37, 400};
  GpuCacheAttentionOptions options;
  options.model_device = 0;
  options.cache_device = devices > 1 ? 1 : 0;
  options.block_tokens = block_tokens;
  options.max_rows = max_rows;
  options.max_context = max_context;
  options.budget_bytes = size_t{64} << 20;
  std::cout << "[ devices   ] model 0, cache " << options.cache_device << "\n";
  ASSERT_EQ(cudaSuccess, cudaSetDevice(0));
  auto remote = GpuCacheAttention::Create(config, options);
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  ASSERT_STATUS_OK((*remote)->SetMeasureWaits(true));
  LocalAttention local(config, block_tokens, 256, max_rows, max_context);
  std::vector<int> sessions;
  for (int s = 0; s < 3; ++s) {
    auto id = (*remote)->OpenSession(max_context);
    ASSERT_TRUE(id.ok()) << id.status().message();
    sessions.push_back(*id);
    local.Open(max_context);
  }
  // Sessions past the budget are refused by name; the ones that fitted go back.
  std::vector<int> extra;
  Result<int> more = (*remote)->OpenSession(max_context);
  while (more.ok() && extra.size() < 1000) {
    extra.push_back(*more);
    more = (*remote)->OpenSession(max_context);
  }
  ASSERT_FALSE(more.ok());
  EXPECT_NE(more.status().message().find("budget"), std::string::npos) << more.status().message();
  for (int session : extra) ASSERT_STATUS_OK((*remote)->CloseSession(session));

  std::mt19937_64 rng = FreshRng();
  const size_t qkv_dim = static_cast<size_t>(config.q_dim() + 2 * config.kv_dim());
  auto qkv =
      std::move(cuda::DeviceBuffer<__nv_bfloat16>::Allocate(max_rows * qkv_dim, "qkv")).value();
  auto out_remote =
      std::move(cuda::DeviceBuffer<__nv_bfloat16>::Allocate(max_rows * config.q_dim(), "out"))
          .value();
  auto out_local =
      std::move(cuda::DeviceBuffer<__nv_bfloat16>::Allocate(max_rows * config.q_dim(), "out"))
          .value();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int lengths[3] = {0, 0, 0};
  for (int step = 0; step < 12; ++step) {
    std::vector<GpuCacheAttention::Row> rows;
    int decode_rows = 0;
    if (step == 0) {  // the prompts: prefill rows only
      for (int s = 0; s < 3; ++s) {
        for (int t = 0; t < prefill[s]; ++t) rows.push_back({s, lengths[s]++});
      }
      ASSERT_LE(static_cast<int>(rows.size()), 512);
    } else {
      for (int s = 0; s < 3; ++s) rows.push_back({s, lengths[s]++});
      decode_rows = 3;
      if (step % 4 == 0) rows.push_back({1, lengths[1]++});  // a decode row plus a chunk row
    }
    // Prefill rows of step 0 go in chunks of at most max_rows.
    for (size_t first = 0; first < rows.size(); first += max_rows) {
      std::vector<GpuCacheAttention::Row> chunk(
          rows.begin() + first, rows.begin() + std::min(rows.size(), first + max_rows));
      for (GpuCacheAttention::Row& row : chunk) row.session = sessions[row.session];
      ASSERT_STATUS_OK((*remote)->PlanStep(chunk, first == 0 ? decode_rows : 0, stream));
      std::vector<GpuCacheAttention::Row> local_rows(rows.begin() + first,
                                                     rows.begin() + first + chunk.size());
      local.Plan(local_rows, first == 0 ? decode_rows : 0);
      for (int layer = 0; layer < config.num_layers; ++layer) {
        const std::vector<float> values = RandomBf16Values(rng, chunk.size() * qkv_dim);
        const std::vector<__nv_bfloat16> bits = ToBf16(values);
        ASSERT_EQ(cudaSuccess, cudaMemcpyAsync(qkv.data(), bits.data(), bits.size() * 2,
                                               cudaMemcpyHostToDevice, stream));
        ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
        if (use_graph && first == 0 && decode_rows > 0) {
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          const Status captured = (*remote)->Layer(layer, qkv.data(), out_remote.data(), stream);
          ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(stream, &graph));
          ASSERT_STATUS_OK(captured);
          ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));
          ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
          ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
          (void)cudaGraphExecDestroy(exec);
          (void)cudaGraphDestroy(graph);
        } else {
          ASSERT_STATUS_OK((*remote)->Layer(layer, qkv.data(), out_remote.data(), stream));
        }
        local.Layer(layer, qkv.data(), out_local.data(), stream);
        ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
        if (first != 0 || decode_rows == 0) continue;
        const size_t count = static_cast<size_t>(decode_rows) * config.q_dim();
        const std::vector<uint16_t> a = Download(out_remote, count);
        const std::vector<uint16_t> b = Download(out_local, count);
        size_t differing = 0;
        for (size_t i = 0; i < count; ++i) differing += a[i] != b[i];
        ASSERT_EQ(differing, 0u) << "step " << step << " layer " << layer << ": " << differing
                                 << " of " << count << " output elements differ";
      }
    }
  }
  // The last step's exposed wait was measured (events inside the graph too) and its bytes do not
  // depend on the context: 3 decode rows (and one chunk row every 4th step) per layer.
  const Result<double> waited = (*remote)->LastStepWaitMs();
  ASSERT_TRUE(waited.ok()) << waited.status().message();
  EXPECT_GE(*waited, 0.0);
  EXPECT_EQ((*remote)->step_bytes_back(),
            static_cast<size_t>(config.num_layers) * 3 * config.q_dim() * 2);
  for (int session : sessions) ASSERT_STATUS_OK((*remote)->CloseSession(session));
  EXPECT_FALSE((*remote)->CloseSession(sessions[0]).ok());
  (void)cudaStreamDestroy(stream);
}

TEST(GpuCacheAttention, GivesLocalDenseBitsBlock16) { RunSteps(16, /*use_graph=*/false); }
TEST(GpuCacheAttention, GivesLocalDenseBitsBlock64) { RunSteps(64, /*use_graph=*/false); }
TEST(GpuCacheAttention, ALayerCapturedInAGraphGivesTheSameBits) {
  RunSteps(16, /*use_graph=*/true);
}

}  // namespace
}  // namespace rubato
