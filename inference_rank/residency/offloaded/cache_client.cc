// CacheRankClient (cache_client.h): sessions and the KV packs out per P layers in the session's
// dtype; the replies are cache_client_replies.cc's.
#include "inference_rank/residency/offloaded/cache_client.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "common/logging.h"

namespace rubato {
namespace {

using transport::MemoryKind;
using transport::TransferId;
using transport::TransferOp;
using Clock = std::chrono::steady_clock;

}  // namespace

std::string CacheRankClient::LayerRange(int first, int count) {
  return count == 1 ? "layer " + std::to_string(first)
                    : "layers " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

std::span<std::byte> CacheRankClient::MessageBuffer::Bytes(uint64_t size) {
  const size_t words_needed = static_cast<size_t>((size + 7) / 8);
  if (words.size() < words_needed) words.resize(words_needed);
  return {reinterpret_cast<std::byte*>(words.data()), static_cast<size_t>(size)};
}

CacheRankClient::CacheRankClient(const CacheClientOptions& options, const ModelConfig& model,
                                 transport::Transport& transport, int cache_peer,
                                 CacheSessionControl& control)
    : options_(options),
      model_(model),
      transport_(transport),
      cache_peer_(cache_peer),
      control_(control) {
  Result<const CacheSelector*> selector = ResolveCacheSelector(options.selection);
  if (selector.ok()) {
    selector_ = *selector;
  } else {  // every call returns the refusal; attention keeps the sizes below well defined
    broken_ = selector.status();
    selector_ = FindCacheSelector("attention");
  }
  pack_layers_ = selector_->traits().serves_same_step
                     ? 1
                     : std::clamp(options.selection.pack_layers > 0 ? options.selection.pack_layers
                                                                    : options.pack_layers,
                                  1, std::max(model.num_layers, 1));
  num_packs_ = (model.num_layers + pack_layers_ - 1) / pack_layers_;
  outgoing_.resize(static_cast<size_t>(num_packs_));
  session_shape_.num_layers = static_cast<uint32_t>(model.num_layers);
  session_shape_.num_kv_heads = static_cast<uint32_t>(model.num_kv_heads);
  session_shape_.num_query_heads = static_cast<uint32_t>(model.num_heads);
  session_shape_.head_dim = static_cast<uint32_t>(model.head_dim);
  session_shape_.dtype = options.kv_dtype;  // the model's
  deltas_ = options.delta_replies && !selector_->traits().partial_attention;
  zero_counts_.assign(static_cast<size_t>(std::max(model.num_kv_heads, 0)), 0);
}

CacheRankClient::~CacheRankClient() {
  // Nothing posted may outlive the buffers it reads or writes.
  for (OutgoingPack& pack : outgoing_) {
    for (const TransferId id : pack.sends) transport_.Cancel(id);
  }
  for (const std::shared_ptr<Reply>& reply : inflight_) {
    if (!reply->arrived) transport_.Cancel(reply->receive);
  }
}

int CacheRankClient::PackLayers(int pack) const {
  return std::min(pack_layers_, model_.num_layers - PackFirstLayer(pack));
}

LayerPackShape CacheRankClient::PackShape(LayerPackKind kind, int pack) const {
  LayerPackShape shape;
  shape.kind = kind;
  shape.step = step_;
  shape.first_layer = static_cast<uint32_t>(PackFirstLayer(pack));
  shape.num_layers = static_cast<uint32_t>(PackLayers(pack));
  shape.dtype = session_shape_.dtype;
  shape.num_kv_heads = session_shape_.num_kv_heads;
  shape.num_query_heads = session_shape_.num_query_heads;
  shape.head_dim = session_shape_.head_dim;
  // Only a KV pack carries the query, and only for a selector that scores it.
  shape.has_query = kind == LayerPackKind::kKvPack && selector_->traits().needs_query;
  shape.delta = deltas_;
  return shape;
}

Status CacheRankClient::Broken(Status why) {
  if (broken_.ok()) {
    broken_ = std::move(why);
    RUBATO_LOG_WARN("offload", "{}: offloaded KV stops: {}", options_.cache_name,
                    broken_.message());
  }
  return broken_;
}

Status CacheRankClient::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(CounterFamily * bytes,
                          registry.AddCounterFamily("rubato:transport_bytes_total",
                                                    "Bytes moved between inference and cache "
                                                    "ranks, by the counting rank's role, "
                                                    "direction and transport backend.",
                                                    {"role", "direction", "backend"}));
  const std::string backend(transport_.BackendName());
  RUBATO_ASSIGN_OR_RETURN(tx_bytes_metric_, bytes->WithLabels({"inference", "tx", backend}));
  RUBATO_ASSIGN_OR_RETURN(rx_bytes_metric_, bytes->WithLabels({"inference", "rx", backend}));
  RUBATO_ASSIGN_OR_RETURN(
      pack_wait_metric_,
      registry.AddHistogram("rubato:pack_wait_seconds",
                            "Time the inference rank waited for a layer pack's reply (or for a "
                            "pack to leave) before it could go on.",
                            {1e-5, 1e-4, 1e-3, 0.01, 0.1, 1, 10}));
  RUBATO_ASSIGN_OR_RETURN(steps_metric_,
                          registry.AddCounter("rubato:offload_steps_total",
                                              "Forward steps of the inference rank that sent "
                                              "offloaded K/V to the cache rank."));
  RUBATO_ASSIGN_OR_RETURN(CounterFamily * rows,
                          registry.AddCounterFamily("rubato:compact_rows_total",
                                                    "Compact K/V rows (a position of a KV head) "
                                                    "the cache rank's replies carried, and those "
                                                    "full replies would have carried.",
                                                    {"reply"}));
  RUBATO_ASSIGN_OR_RETURN(rows_received_metric_, rows->WithLabels({"received"}));
  RUBATO_ASSIGN_OR_RETURN(rows_full_metric_, rows->WithLabels({"full"}));
  return Status::Ok();
}

// ---- sessions ---------------------------------------------------------------------------------

Result<uint64_t> CacheRankClient::OpenSession(uint64_t request_id, int capacity_tokens) {
  if (!broken_.ok()) return broken_;
  if (capacity_tokens < 1) {
    return InvalidArgumentError("offload: a session needs a capacity of >= 1 tokens, got " +
                                std::to_string(capacity_tokens));
  }
  SessionShape shape = session_shape_;
  shape.capacity_tokens = static_cast<uint32_t>(capacity_tokens);
  RUBATO_ASSIGN_OR_RETURN(const uint64_t session,
                          control_.OpenSession(request_id, shape, options_.selection));
  SessionState& state = sessions_[session];
  state.pools.resize(static_cast<size_t>(model_.num_layers));
  state.pool_capacity =
      std::max(0, selector_->ReplyRangeFor(options_.selection, capacity_tokens - 1, 1).slots);
  return session;
}

Status CacheRankClient::CloseSession(uint64_t session_id) {
  // The control plane overtakes the data plane: the cache rank must have taken the session's
  // last packs before it is closed, else it would read them as packs of an unknown session. Packs
  // are processed in order, so the replies of the session's last step say it has.
  std::shared_ptr<StepReplies> last;
  const auto in_step =
      std::find_if(step_requests_.begin(), step_requests_.end(),
                   [&](const LayerPackRequest& r) { return r.session_id == session_id; });
  if (in_step != step_requests_.end() && step_replies_ != nullptr) {
    last = step_replies_;
  } else if (const auto found = sessions_.find(session_id); found != sessions_.end()) {
    last = found->second.replies;
  }
  sessions_.erase(session_id);
  if (last != nullptr && broken_.ok()) {
    for (size_t pack = 0; pack < last->packs.size(); ++pack) {
      if (last->packs[pack] == nullptr) continue;  // not sent: the step failed part way
      RUBATO_RETURN_IF_ERROR(AwaitReply(*last->packs[pack], last->step, static_cast<int>(pack)));
    }
  }
  return control_.CloseSession(session_id);
}

// ---- outgoing packs ---------------------------------------------------------------------------

Status CacheRankClient::LayerComputed(int layer, std::span<const OffloadLayerKv> entries) {
  if (!broken_.ok()) return broken_;
  if (layer < 0 || layer >= model_.num_layers) {
    return InvalidArgumentError("offload: layer " + std::to_string(layer) + " outside [0, " +
                                std::to_string(model_.num_layers) + ")");
  }
  widened_.clear();  // CompactFor's rows of the previous layer are no longer read
  if (layer == 0) RUBATO_RETURN_IF_ERROR(StartStep(entries));
  if (entries.size() != step_requests_.size()) {
    return InvalidArgumentError("offload: layer " + std::to_string(layer) + " hands over " +
                                std::to_string(entries.size()) + " entries, layer 0 had " +
                                std::to_string(step_requests_.size()));
  }
  const int pack = PackOf(layer);
  if (layer == PackFirstLayer(pack)) {
    OutgoingPack& outgoing = outgoing_[static_cast<size_t>(pack)];
    for (const TransferId id : outgoing.sends) {
      RUBATO_RETURN_IF_ERROR(Wait(id, "sending the KV pack of " +
                                          LayerRange(PackFirstLayer(pack), PackLayers(pack))));
    }
    outgoing.sends.clear();
    const LayerPackShape shape = PackShape(LayerPackKind::kKvPack, pack);
    RUBATO_ASSIGN_OR_RETURN(const uint64_t bytes, KvPackBytes(shape, step_requests_));
    RUBATO_ASSIGN_OR_RETURN(LayerPackWriter writer,
                            LayerPackWriter::Create(shape, step_requests_,
                                                    outgoing.buffer.Bytes(bytes)));
    writer_ = std::make_unique<LayerPackWriter>(std::move(writer));
  }
  RUBATO_RETURN_IF_ERROR(WritePackLayer(layer, entries));
  if (layer == PackFirstLayer(pack) + PackLayers(pack) - 1) RUBATO_RETURN_IF_ERROR(SendPack(pack));
  return Status::Ok();
}

Status CacheRankClient::StartStep(std::span<const OffloadLayerKv> entries) {
  // Every delta reply of the last step is applied before the next: the pools and the cache
  // rank's slot maps move together, and replies' receives are posted in order.
  if (deltas_ && step_replies_ != nullptr) {
    for (size_t pack = 0; pack < step_replies_->packs.size(); ++pack) {
      if (step_replies_->packs[pack] == nullptr) continue;
      RUBATO_RETURN_IF_ERROR(AwaitReply(*step_replies_->packs[pack], step_replies_->step,
                                        static_cast<int>(pack)));
    }
  }
  ++step_;
  if (steps_metric_ != nullptr) steps_metric_->Increment();
  // Replies nobody will read again (their sessions moved on or closed) are dropped once their
  // receive is done; the transport still writes into a buffer until then.
  std::erase_if(inflight_, [&](const std::shared_ptr<Reply>& reply) {
    if (!reply->arrived && reply.use_count() == 1) {
      const Result<bool> done = transport_.Test(reply->receive);
      if (done.ok() && *done) {
        reply->arrived = true;
        bytes_received_ += reply->bytes;
        if (rx_bytes_metric_ != nullptr) {
          rx_bytes_metric_->Increment(static_cast<double>(reply->bytes));
        }
      }
      if (!done.ok()) (void)Broken(done.status());
    }
    return reply->arrived && reply.use_count() == 1;
  });
  RUBATO_RETURN_IF_ERROR(broken_);
  if (step_replies_ != nullptr && step_sent_) {
    // The last step went out whole: its sessions' next decode tokens (this step's) read its
    // replies. Not earlier: layers of that step still attended the step before.
    for (uint32_t i = 0; i < step_requests_.size(); ++i) {
      const auto session = sessions_.find(step_requests_[i].session_id);
      if (session == sessions_.end()) continue;  // closed since
      session->second.replies = step_replies_;
      session->second.request_index = i;
      session->second.request = step_requests_[i];
    }
  }
  step_sent_ = false;
  step_requests_.clear();
  for (const OffloadLayerKv& entry : entries) {
    const auto session = sessions_.find(entry.session_id);
    if (session == sessions_.end()) {
      return InvalidArgumentError("offload: session " + std::to_string(entry.session_id) +
                                  " is not open on " + options_.cache_name);
    }
    if (entry.tokens < 1 || entry.start_position < 0) {
      return InvalidArgumentError("offload: entry of session " +
                                  std::to_string(entry.session_id) + " has " +
                                  std::to_string(entry.tokens) + " tokens at position " +
                                  std::to_string(entry.start_position));
    }
    LayerPackRequest request;
    request.session_id = entry.session_id;
    request.first_position = static_cast<uint32_t>(entry.start_position);
    request.new_tokens = static_cast<uint32_t>(entry.tokens);
    const ReplyRange range =
        selector_->ReplyRangeFor(options_.selection, entry.start_position, entry.tokens);
    request.reply_slots = static_cast<uint32_t>(range.slots);
    request.attention_queries = static_cast<uint32_t>(range.attention_queries);
    session->second.decode_steps = entry.tokens == 1 ? session->second.decode_steps + 1 : 0;
    if (deltas_) {  // a session's first pack asks for full replies: its pools are empty
      request.delta_reset = session->second.pools_empty ? 1 : 0;
      session->second.pools_empty = false;
    }
    step_requests_.push_back(request);
  }
  step_replies_ = std::make_shared<StepReplies>();
  step_replies_->step = step_;
  step_replies_->requests = step_requests_;
  step_replies_->packs.resize(static_cast<size_t>(num_packs_));
  return Status::Ok();
}

Status CacheRankClient::WritePackLayer(int layer, std::span<const OffloadLayerKv> entries) {
  const uint32_t layer_index = static_cast<uint32_t>(layer - PackFirstLayer(PackOf(layer)));
  const int kv_heads = model_.num_kv_heads;
  const int head_dim = model_.head_dim;
  for (uint32_t i = 0; i < entries.size(); ++i) {
    const OffloadLayerKv& entry = entries[i];
    const LayerPackRequest& request = step_requests_[i];
    if (entry.session_id != request.session_id ||
        entry.start_position != static_cast<int>(request.first_position) ||
        entry.tokens != static_cast<int>(request.new_tokens)) {
      return InvalidArgumentError("offload: layer " + std::to_string(layer) + " entry " +
                                  std::to_string(i) + " differs from layer 0's");
    }
    if (entry.memory != OffloadMemory::kHost) {
      return UnsupportedError("offload: layer " + std::to_string(layer) + " entry " +
                              std::to_string(i) + " hands over device buffers; this client "
                              "writes host packs");
    }
    // The model's rows are [tokens][kv_heads][head_dim]; the pack's [kv_heads][tokens][head_dim].
    const size_t from_row = head_dim * DTypeSize(entry.dtype);
    const size_t to_row = head_dim * DTypeSize(session_shape_.dtype);
    std::byte* keys = writer_->Key(layer_index, i).data();
    std::byte* values = writer_->Value(layer_index, i).data();
    const auto* entry_keys = static_cast<const std::byte*>(entry.keys);
    const auto* entry_values = static_cast<const std::byte*>(entry.values);
    for (int h = 0; h < kv_heads; ++h) {
      for (int t = 0; t < entry.tokens; ++t) {
        const size_t from = static_cast<size_t>(t) * kv_heads + h;
        const size_t to = static_cast<size_t>(h) * entry.tokens + t;
        WriteElements(entry.dtype, entry_keys + from * from_row, keys + to * to_row, head_dim);
        WriteElements(entry.dtype, entry_values + from * from_row, values + to * to_row,
                      head_dim);
      }
    }
    const std::span<std::byte> query = writer_->Query(layer_index, i);
    if (!query.empty()) {
      WriteElements(entry.dtype, entry.last_query, query.data(),
                    static_cast<size_t>(model_.num_heads) * head_dim);
    }
  }
  return Status::Ok();
}

void CacheRankClient::WriteElements(DType dtype, const void* from, std::byte* to, size_t count) {
  if (dtype == session_shape_.dtype) {
    std::memcpy(to, from, count * DTypeSize(dtype));
  } else if (dtype == DType::kF32) {
    ConvertFromF32(session_shape_.dtype, static_cast<const float*>(from), to, count);
  } else {
    convert_.resize(count);
    ConvertToF32(dtype, from, convert_.data(), count);
    ConvertFromF32(session_shape_.dtype, convert_.data(), to, count);
  }
}

Status CacheRankClient::SendPack(int pack) {
  OutgoingPack& outgoing = outgoing_[static_cast<size_t>(pack)];
  const std::span<std::byte> message = writer_->bytes();
  const TransferOp sends[] = {
      TransferOp::Send(cache_peer_, kPackHeaderTag, message.data(), sizeof(LayerPackHeader)),
      TransferOp::Send(cache_peer_, kPackTag, message.data(), message.size())};
  const Result<TransferId> sent = transport_.Post(sends);
  if (!sent.ok()) return Broken(sent.status().WithContext(options_.cache_name));
  outgoing.sends.push_back(*sent);
  bytes_sent_ += message.size() + sizeof(LayerPackHeader);
  if (tx_bytes_metric_ != nullptr) {
    tx_bytes_metric_->Increment(static_cast<double>(message.size() + sizeof(LayerPackHeader)));
  }

  RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<Reply> reply, PostReplyReceive(pack));
  inflight_.push_back(reply);
  step_replies_->packs[static_cast<size_t>(pack)] = reply;

  step_sent_ = pack == num_packs_ - 1;
  return Status::Ok();
}

}  // namespace rubato
