// CacheRankClient (cache_client.h): replies in, compact KV served to the model's two-segment
// attention or partial attention taken as the decode token's.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "common/logging.h"
#include "inference_rank/residency/offloaded/cache_client.h"

namespace rubato {
namespace {

using transport::MemoryKind;
using transport::TransferId;
using transport::TransferOp;
using Clock = std::chrono::steady_clock;

// How often a wait on the data plane looks at the control plane's health.
constexpr std::chrono::milliseconds kHealthPollInterval{20};

// A reply's request entry against the pack's: equal but for the delta fields, which the cache
// rank fills in.
bool SameRequest(LayerPackRequest reply, const LayerPackRequest& pack) {
  reply.delta_rows = pack.delta_rows;
  reply.delta_reset = pack.delta_reset;
  return reply == pack;
}

}  // namespace

// ---- replies ----------------------------------------------------------------------------------

Status CacheRankClient::Wait(TransferId id, const std::string& what) {
  // Done already (the reply came while the model computed): nothing was waited for.
  const Result<bool> done = transport_.Test(id);
  if (done.ok() && *done) return Status::Ok();
  if (!done.ok()) {
    return Broken(Status(done.status().code(),
                         options_.cache_name + ": " + what + ": " + done.status().message()));
  }
  ++waits_blocked_;
  const auto start = Clock::now();
  const auto deadline = start + options_.timeout;
  Status result;
  while (true) {
    const auto now = Clock::now();
    const auto slice = std::min<std::chrono::nanoseconds>(kHealthPollInterval, deadline - now);
    const Status waited =
        transport_.Wait(id, std::chrono::duration_cast<std::chrono::milliseconds>(slice));
    if (waited.ok()) break;
    if (waited.code() != StatusCode::kDeadlineExceeded) {
      result = Broken(
          Status(waited.code(), options_.cache_name + ": " + what + ": " + waited.message()));
      break;
    }
    const Status health = control_.Health();
    if (!health.ok()) {
      result = Broken(UnavailableError(options_.cache_name + " is lost (" + health.message() +
                                       ") while " + what));
      break;
    }
    if (Clock::now() >= deadline) {
      result = Broken(DeadlineExceededError(options_.cache_name + ": no progress within " +
                                            std::to_string(options_.timeout.count()) +
                                            " ms while " + what));
      break;
    }
  }
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  pack_wait_seconds_ += waited;
  if (pack_wait_metric_ != nullptr) pack_wait_metric_->Observe(waited);
  return result;
}

Status CacheRankClient::AwaitReply(Reply& reply, uint64_t step, int pack) {
  if (reply.arrived && reply.view != nullptr) return Status::Ok();
  const std::string what = "waiting for the reply to " +
                           LayerRange(PackFirstLayer(pack), PackLayers(pack)) + " of step " +
                           std::to_string(step);
  if (reply.delta && !reply.header_arrived) RUBATO_RETURN_IF_ERROR(AwaitDeltaHeader(reply, what));
  if (!reply.arrived) RUBATO_RETURN_IF_ERROR(Wait(reply.receive, what));
  reply.arrived = true;
  bytes_received_ += reply.bytes;
  if (rx_bytes_metric_ != nullptr) rx_bytes_metric_->Increment(static_cast<double>(reply.bytes));
  const std::span<const std::byte> bytes = reply.buffer.Bytes(reply.bytes);
  Result<LayerPackView> view = LayerPackView::Parse(bytes);
  if (!view.ok()) return Broken(view.status().WithContext(options_.cache_name + ": " + what));
  const Status contents = ValidateReplyContents(*view);
  if (!contents.ok()) return Broken(contents.WithContext(options_.cache_name + ": " + what));
  if (view->kind() != LayerPackKind::kReplyPack || view->step() != step ||
      view->first_layer() != static_cast<uint32_t>(PackFirstLayer(pack)) ||
      view->num_layers() != static_cast<uint32_t>(PackLayers(pack))) {
    return Broken(DataLossError(
        options_.cache_name + ": " + what + ": got a reply for step " +
        std::to_string(view->step()) + ", " +
        LayerRange(static_cast<int>(view->first_layer()), static_cast<int>(view->num_layers()))));
  }
  if (view->delta() != reply.delta) {
    return Broken(DataLossError(options_.cache_name + ": " + what + ": a " +
                                (view->delta() ? "delta" : "full") +
                                " reply to a pack that "
                                "asked for " +
                                (reply.delta ? "deltas" : "full replies")));
  }
  reply.view = std::make_unique<LayerPackView>(std::move(view).value());
  if (reply.delta) RUBATO_RETURN_IF_ERROR(ApplyDeltaReply(*reply.view));
  return Status::Ok();
}

Result<std::pair<const LayerPackView*, uint32_t>> CacheRankClient::SameStepReply(
    int layer, uint64_t session_id, int position) {
  const auto in_step =
      std::find_if(step_requests_.begin(), step_requests_.end(),
                   [&](const LayerPackRequest& r) { return r.session_id == session_id; });
  if (in_step == step_requests_.end() || static_cast<int>(in_step->first_position) != position) {
    return FailedPreconditionError("offload: session " + std::to_string(session_id) +
                                   " at position " + std::to_string(position) +
                                   " is not in this step's packs");
  }
  const uint32_t index = static_cast<uint32_t>(in_step - step_requests_.begin());
  const int pack = PackOf(layer);
  const std::shared_ptr<Reply>& reply = step_replies_->packs[static_cast<size_t>(pack)];
  if (reply == nullptr) {
    return FailedPreconditionError("offload: the pack of layer " + std::to_string(layer) +
                                   " was not sent before its reply was asked for");
  }
  RUBATO_RETURN_IF_ERROR(AwaitReply(*reply, step_replies_->step, pack));
  if (!SameRequest(reply->view->requests()[index], *in_step)) {
    return Broken(DataLossError(options_.cache_name + ": the reply's request table differs "
                                                      "from the pack's"));
  }
  return std::pair<const LayerPackView*, uint32_t>{reply->view.get(), index};
}

Result<OffloadCompactKv> CacheRankClient::CompactFor(int layer, uint64_t session_id, int position) {
  if (!broken_.ok()) return broken_;
  const auto found = sessions_.find(session_id);
  if (found == sessions_.end()) {
    return InvalidArgumentError("offload: session " + std::to_string(session_id) +
                                " is not open on " + options_.cache_name);
  }
  if (selector_->traits().partial_attention) {
    return FailedPreconditionError("offload: session " + std::to_string(session_id) + " (" +
                                   std::string(selector_->name()) +
                                   " selector) gets its "
                                   "attention from " +
                                   options_.cache_name + " (PartialFor), not compact KV");
  }
  // A decode token attends the reply of the session's previous step, or the current step's for
  // a selector that serves the same step.
  const LayerPackView* view = nullptr;
  uint32_t index = 0;
  LayerPackRequest request;
  int recent_begin = 0;
  const int pack = PackOf(layer);
  if (!selector_->traits().serves_same_step) {
    const SessionState& session = found->second;
    if (session.decode_steps <= options_.selection.dense_steps) {
      // Dense warm-up: the whole context from the local paged cache, no compact rows (the
      // replies still fill the pools; StartStep applies them).
      OffloadCompactKv dense;
      dense.compact = CompactKvView{nullptr, nullptr, model_.num_kv_heads, 0, model_.head_dim};
      dense.counts = zero_counts_.data();
      dense.recent_begin = 0;
      return dense;
    }
    if (session.replies == nullptr) {
      return FailedPreconditionError("offload: session " + std::to_string(session_id) +
                                     " has no reply yet: its first tokens must be a prefill");
    }
    request = session.request;
    const int next = static_cast<int>(request.first_position + request.new_tokens);
    if (position != next) {
      return FailedPreconditionError("offload: session " + std::to_string(session_id) +
                                     " decodes position " + std::to_string(position) +
                                     " but its last step ended at " + std::to_string(next));
    }
    index = session.request_index;
    // The reply was made for this token: its range is the last entry's next token's.
    recent_begin = selector_
                       ->ReplyRangeFor(options_.selection, static_cast<int>(request.first_position),
                                       static_cast<int>(request.new_tokens))
                       .recent_begin;
    const std::shared_ptr<Reply>& reply = session.replies->packs[static_cast<size_t>(pack)];
    if (reply == nullptr) {
      return FailedPreconditionError("offload: the pack of layer " + std::to_string(layer) +
                                     " was not sent before its compact KV was asked for");
    }
    RUBATO_RETURN_IF_ERROR(AwaitReply(*reply, session.replies->step, pack));
    if (!SameRequest(reply->view->requests()[index], request)) {
      return Broken(DataLossError(options_.cache_name + ": the reply's request table differs "
                                                        "from the pack's"));
    }
    view = reply->view.get();
  } else {
    RUBATO_ASSIGN_OR_RETURN(const auto reply, SameStepReply(layer, session_id, position));
    view = reply.first;
    index = reply.second;
    request = view->requests()[index];
    recent_begin = selector_->ReplyRangeFor(options_.selection, position, 1).recent_begin;
  }
  if (deltas_) {
    return PoolCompactKv(session_id, found->second, layer, static_cast<int>(request.reply_slots),
                         recent_begin);
  }
  const uint32_t layer_index = static_cast<uint32_t>(layer - PackFirstLayer(pack));
  const std::span<const std::byte> counts = view->Counts(layer_index, index);
  const std::span<const std::byte> positions = view->Positions(layer_index, index);
  const int slots = static_cast<int>(request.reply_slots);
  const int kv_heads = model_.num_kv_heads;
  // Every head must carry its whole range, and nothing from the recent segment: a short or
  // overlapping reply would be a silently wrong attention.
  for (int h = 0; h < kv_heads; ++h) {
    const int count = LoadInt32(counts, static_cast<size_t>(h));
    const int last =
        count > 0 ? LoadInt32(positions, static_cast<size_t>(h) * slots + count - 1) : -1;
    if (count != slots || last >= recent_begin) {
      return Broken(DataLossError(options_.cache_name + ": reply for session " +
                                  std::to_string(session_id) + " layer " + std::to_string(layer) +
                                  " KV head " + std::to_string(h) + " has " +
                                  std::to_string(count) + " rows ending at position " +
                                  std::to_string(last) + ", expected " + std::to_string(slots) +
                                  " rows before position " + std::to_string(recent_begin)));
    }
  }
  // The compact view is f32: rows of another session dtype are widened.
  const std::span<const std::byte> keys = view->Key(layer_index, index);
  const std::span<const std::byte> values = view->Value(layer_index, index);
  const float* compact_keys = reinterpret_cast<const float*>(keys.data());
  const float* compact_values = reinterpret_cast<const float*>(values.data());
  if (view->dtype() != DType::kF32 && slots > 0) {
    const size_t count = static_cast<size_t>(kv_heads) * slots * model_.head_dim;
    for (const std::span<const std::byte> rows : {keys, values}) {
      std::vector<float>& wide = widened_.emplace_back(count);
      ConvertToF32(view->dtype(), rows.data(), wide.data(), count);
    }
    compact_keys = widened_[widened_.size() - 2].data();
    compact_values = widened_.back().data();
  }
  OffloadCompactKv compact;
  compact.compact =
      CompactKvView{const_cast<float*>(compact_keys), const_cast<float*>(compact_values), kv_heads,
                    slots, model_.head_dim};
  compact.counts = reinterpret_cast<const int*>(counts.data());
  compact.recent_begin = recent_begin;
  return compact;
}

bool CacheRankClient::ServesPartialAttention(uint64_t session_id) const {
  return selector_->traits().partial_attention && sessions_.contains(session_id);
}

Result<OffloadPartial> CacheRankClient::PartialFor(int layer, uint64_t session_id, int position) {
  if (!broken_.ok()) return broken_;
  if (!ServesPartialAttention(session_id)) {
    return FailedPreconditionError("offload: session " + std::to_string(session_id) +
                                   " is not open on " + options_.cache_name +
                                   " with a selector "
                                   "that replies partial attention (" +
                                   std::string(selector_->name()) + ")");
  }
  RUBATO_ASSIGN_OR_RETURN(const auto reply, SameStepReply(layer, session_id, position));
  const LayerPackView& view = *reply.first;
  const uint32_t layer_index = static_cast<uint32_t>(layer - PackFirstLayer(PackOf(layer)));
  const std::span<const std::byte> output = view.AttentionOutput(layer_index, reply.second);
  const std::span<const std::byte> lse = view.AttentionLse(layer_index, reply.second);
  const size_t heads = static_cast<size_t>(model_.num_heads);
  if (output.size() != heads * model_.head_dim * sizeof(float) ||
      lse.size() != heads * sizeof(float)) {
    return Broken(DataLossError(options_.cache_name + ": the reply for session " +
                                std::to_string(session_id) + " layer " + std::to_string(layer) +
                                " carries no attention of its query"));
  }
  // Sections start 16-byte aligned in 8-byte aligned buffers: f32 reads are aligned.
  return OffloadPartial{reinterpret_cast<const float*>(output.data()),
                        reinterpret_cast<const float*>(lse.data())};
}

}  // namespace rubato
