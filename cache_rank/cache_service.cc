// CacheService (cache_service.h): sessions, peers, and the data-plane thread's receive /
// append / select / gather / reply cycle.
#include "cache_rank/cache_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "cache_rank/reply_builder.h"
#include "common/logging.h"
#include "transport/pack_protocol.h"

namespace rubato {
namespace {

using transport::TransferId;
using transport::TransferOp;

constexpr const char* kLogSubsystem = "cache";
// How long the loop sleeps when no peer made progress (a busy loop would take a core from the
// model on a shared machine).
constexpr std::chrono::microseconds kIdleSleep{50};
// How long the oldest reply may take to leave while the next pack waits for room.
constexpr std::chrono::milliseconds kReplySendTimeout{60000};
// Replies of one peer in flight at once. A delta reply leaves only when the inference rank,
// having read its header, posts the receive of its body, which it does when it needs the reply:
// with one reply in flight the next pack would wait for that (the cache rank would work in step
// with the model instead of ahead of it, the schedule asyncspade needs). A client has at most the
// packs of two steps unanswered.
constexpr size_t kMaxRepliesInFlight = 256;

std::span<std::byte> AsBytes(std::vector<uint64_t>& words, uint64_t bytes) {
  const size_t needed = static_cast<size_t>((bytes + 7) / 8);
  if (words.size() < needed) words.resize(needed);
  return {reinterpret_cast<std::byte*>(words.data()), static_cast<size_t>(bytes)};
}

}  // namespace

struct CacheService::Peer {
  // kReplyPending: a pack has arrived while kMaxRepliesInFlight replies are still leaving; it is
  // processed once the oldest send completes (waited for across sweeps, never with the mutex
  // held, so control-plane calls are served meanwhile).
  enum class Phase { kIdle, kHeader, kBody, kReplyPending };
  // A reply posted and not yet delivered: its buffer stays until the send completes.
  struct SentReply {
    std::vector<uint64_t> buffer;
    uint64_t bytes = 0;
    bool delta = false;
    TransferId send = 0;
  };

  uint64_t id = 0;
  std::unique_ptr<transport::Transport> transport;
  int rank = 0;
  Phase phase = Phase::kIdle;
  std::vector<uint64_t> header;  // LayerPackHeader, 8-byte aligned
  std::vector<uint64_t> body;    // the KV pack
  uint64_t body_bytes = 0;
  std::vector<uint64_t> reply;  // the reply pack being built
  uint64_t reply_bytes = 0;
  bool reply_delta = false;  // a delta reply: its header leaves first (kReplyHeaderTag)
  TransferId receive = 0;
  std::deque<SentReply> sending;             // oldest first
  std::vector<std::vector<uint64_t>> spare;  // buffers of delivered replies, for reuse
  std::chrono::steady_clock::time_point reply_wait_since;  // kReplyPending: since when
  Status health;                       // the error that stopped this peer, or ok
  Counter* tx_bytes_metric = nullptr;  // rubato:transport_bytes_total children, once looked up
  Counter* rx_bytes_metric = nullptr;
};

CacheService::CacheService(const CacheServiceOptions& options)
    : options_(options), store_(KvStoreOptions{options.budget_bytes, options.allocator}) {}

CacheService::~CacheService() { Stop(); }

// ---- control plane ----------------------------------------------------------------------------

Result<uint64_t> CacheService::OpenSession(uint64_t peer, uint64_t request_id,
                                           const SessionShape& shape,
                                           const CacheSelectorSpec& selector) {
  RUBATO_ASSIGN_OR_RETURN(const CacheSelector* found, ResolveCacheSelector(selector));
  RUBATO_ASSIGN_OR_RETURN(const uint64_t bytes, KvSessionBytes(shape));
  const ControlLock lock(*this);
  RUBATO_RETURN_IF_ERROR(CheckPeerLimits(peer, request_id, bytes));
  RUBATO_ASSIGN_OR_RETURN(const uint64_t session, store_.OpenSession(request_id, shape));
  // The most rows a reply of this session can carry per KV head: its last position's range.
  const int capacity = std::max(
      0, found->ReplyRangeFor(selector, static_cast<int>(shape.capacity_tokens) - 1, 1).slots);
  sessions_[session] = SessionInfo{peer,
                                   found,
                                   selector,
                                   bytes,
                                   {},
                                   static_cast<uint32_t>(capacity),
                                   found->NewState(selector, shape)};
  UpdateStoreGauges();
  RUBATO_LOG_DEBUG(kLogSubsystem, "peer {} opened session {} for request {} ({} selector)", peer,
                   session, request_id, found->name());
  return session;
}

Status CacheService::CheckPeerLimits(uint64_t peer, uint64_t request_id, uint64_t bytes) const {
  uint64_t held = 0;
  int open = 0;
  for (const auto& [id, info] : sessions_) {
    if (info.peer != peer) continue;
    held += info.bytes;
    ++open;
  }
  if (open >= options_.max_sessions_per_peer) {
    return ResourceExhaustedError("cache rank: request " + std::to_string(request_id) + ": peer " +
                                  std::to_string(peer) + " already has " + std::to_string(open) +
                                  " sessions open, its limit (cache " + "--max-sessions-per-peer " +
                                  std::to_string(options_.max_sessions_per_peer) + ")");
  }
  const uint64_t limit = options_.peer_budget_bytes;
  if (limit > 0 && (bytes > limit || held > limit - bytes)) {
    return ResourceExhaustedError("cache rank: request " + std::to_string(request_id) + " needs " +
                                  std::to_string(bytes) + " bytes but its peer " +
                                  std::to_string(peer) + " holds " + std::to_string(held) +
                                  " of its " + std::to_string(limit) + " (cache --peer-budget-mb)");
  }
  return Status::Ok();
}

Status CacheService::CloseSession(uint64_t peer, uint64_t session_id) {
  const ControlLock lock(*this);
  const auto found = sessions_.find(session_id);
  if (found == sessions_.end() || found->second.peer != peer) {
    return NotFoundError("close session: session " + std::to_string(session_id) +
                         " is not open for this peer");
  }
  if (found->second.state != nullptr) closed_predictions_.Add(found->second.state->counters);
  sessions_.erase(found);
  const Status closed = store_.CloseSession(session_id);
  UpdateStoreGauges();
  return closed;
}

void CacheService::ForgetPeer(uint64_t peer) {
  const ControlLock lock(*this);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.peer != peer) {
      ++it;
      continue;
    }
    (void)store_.CloseSession(it->first);
    if (it->second.state != nullptr) closed_predictions_.Add(it->second.state->counters);
    it = sessions_.erase(it);
  }
  UpdateStoreGauges();
  // The data-plane thread is not inside Progress while we hold the mutex: the transport is not
  // in use and may go (its destructor cancels what it still has posted).
  if (peers_.erase(peer) > 0) RUBATO_LOG_INFO(kLogSubsystem, "peer {} forgotten", peer);
}

Status CacheService::PeerHealth(uint64_t peer) const {
  const ControlLock lock(*this);
  const auto found = peers_.find(peer);
  if (found == peers_.end()) {
    return NotFoundError("peer " + std::to_string(peer) + " has no data plane on this cache rank");
  }
  return found->second->health;
}

CacheServiceStats CacheService::Stats() const {
  CacheServiceStats stats;
  stats.store = store_.Stats();
  stats.packs_received = packs_received_.load();
  stats.bytes_received = bytes_received_.load();
  stats.replies_sent = replies_sent_.load();
  stats.replies_posted = replies_posted_.load();
  stats.bytes_sent = bytes_sent_.load();
  stats.selection_seconds = static_cast<double>(selection_nanoseconds_.load()) * 1e-9;
  if (options_.allocator != nullptr) stats.memory = std::string(options_.allocator->name());
  const ControlLock lock(*this);
  stats.peers = peers_.size();
  stats.predictions = closed_predictions_;
  for (const auto& [id, info] : sessions_) {
    if (info.state != nullptr) stats.predictions.Add(info.state->counters);
  }
  return stats;
}

Status CacheService::RegisterMetrics(MetricsRegistry& registry) {
  const ControlLock lock(*this);
  RUBATO_ASSIGN_OR_RETURN(sessions_metric_,
                          registry.AddGauge("rubato:cache_rank_sessions",
                                            "Sessions (requests) holding KV on this cache rank."));
  RUBATO_ASSIGN_OR_RETURN(GaugeFamily * memory,
                          registry.AddGaugeFamily("rubato:cache_rank_memory_bytes",
                                                  "KV storage of this cache rank: reserved by "
                                                  "open sessions, the most ever reserved, and "
                                                  "the budget.",
                                                  {"kind"}));
  RUBATO_ASSIGN_OR_RETURN(reserved_bytes_metric_, memory->WithLabels({"reserved"}));
  RUBATO_ASSIGN_OR_RETURN(peak_bytes_metric_, memory->WithLabels({"peak"}));
  RUBATO_ASSIGN_OR_RETURN(Gauge * budget, memory->WithLabels({"budget"}));
  budget->Set(static_cast<double>(options_.budget_bytes));
  RUBATO_ASSIGN_OR_RETURN(transport_bytes_metric_,
                          registry.AddCounterFamily("rubato:transport_bytes_total",
                                                    "Bytes moved between inference and cache "
                                                    "ranks, by the counting rank's role, "
                                                    "direction and transport backend.",
                                                    {"role", "direction", "backend"}));
  RUBATO_ASSIGN_OR_RETURN(
      selection_metric_,
      registry.AddHistogramFamily("rubato:selection_latency_seconds",
                                  "Time the cache rank took to select and "
                                  "build one layer pack's reply (attention "
                                  "on the cache rank included), by selector.",
                                  {1e-5, 1e-4, 1e-3, 0.01, 0.1, 1, 10}, {"selector"}));
  UpdateStoreGauges();
  return Status::Ok();
}

void CacheService::UpdateStoreGauges() {
  if (sessions_metric_ == nullptr) return;
  const KvStoreStats stats = store_.Stats();
  sessions_metric_->Set(static_cast<double>(stats.sessions_open));
  reserved_bytes_metric_->Set(static_cast<double>(stats.bytes_reserved));
  peak_bytes_metric_->Set(static_cast<double>(stats.bytes_reserved_peak));
}

// ---- data plane -------------------------------------------------------------------------------

Status CacheService::AddPeer(uint64_t peer, std::unique_ptr<transport::Transport> transport,
                             int peer_rank) {
  if (transport == nullptr) return InvalidArgumentError("cache service: peer without transport");
  if (peer_rank < 0 || peer_rank >= transport->WorldSize() || peer_rank == transport->Rank()) {
    return InvalidArgumentError("cache service: peer rank " + std::to_string(peer_rank) +
                                " is not another rank of the transport");
  }
  auto state = std::make_unique<Peer>();
  state->id = peer;
  state->transport = std::move(transport);
  state->rank = peer_rank;
  const ControlLock lock(*this);
  if (peers_.contains(peer)) {
    return FailedPreconditionError("cache service: peer " + std::to_string(peer) +
                                   " already has a data plane");
  }
  peers_[peer] = std::move(state);
  return Status::Ok();
}

void CacheService::Start() {
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] { Run(); });
}

void CacheService::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mutex_);
  peers_.clear();  // transports cancel what they still have posted
}

CacheService::ControlLock::ControlLock(const CacheService& service) {
  ++service.control_waiting_;
  lock_ = std::unique_lock<std::mutex>(service.mutex_);
  --service.control_waiting_;
}

void CacheService::Run() {
  while (!stop_) {
    bool progressed = false;
    {
      std::lock_guard lock(mutex_);
      for (auto& [id, peer] : peers_) {
        if (!peer->health.ok()) continue;
        progressed |= Progress(*peer);
      }
    }
    // Hand the mutex to a waiting control-plane call before the next sweep.
    while (control_waiting_.load() > 0 && !stop_) std::this_thread::yield();
    if (!progressed) std::this_thread::sleep_for(kIdleSleep);
  }
}

// The peer's transport-bytes counter for `direction` ("tx" / "rx"), looked up once.
Counter* CacheService::TransportBytes(Peer& peer, bool sent) {
  Counter*& counter = sent ? peer.tx_bytes_metric : peer.rx_bytes_metric;
  if (counter == nullptr && transport_bytes_metric_ != nullptr) {
    const Result<Counter*> found = transport_bytes_metric_->WithLabels(
        {"cache", sent ? "tx" : "rx", std::string(peer.transport->BackendName())});
    if (found.ok()) counter = *found;
  }
  return counter;
}

void CacheService::CountReplySent(Peer& peer, uint64_t reply_bytes, bool delta) {
  ++replies_sent_;
  const uint64_t bytes = reply_bytes + (delta ? sizeof(LayerPackHeader) : 0);
  bytes_sent_ += bytes;
  if (Counter* tx = TransportBytes(peer, /*sent=*/true)) tx->Increment(static_cast<double>(bytes));
}

void CacheService::CountReceived(Peer& peer, uint64_t bytes) {
  bytes_received_ += bytes;
  if (Counter* rx = TransportBytes(peer, /*sent=*/false)) rx->Increment(static_cast<double>(bytes));
}

bool CacheService::Progress(Peer& peer) {
  transport::Transport& transport = *peer.transport;
  const auto fail = [&](const Status& why) {
    peer.health = why.WithContext("cache rank: data plane of peer " + std::to_string(peer.id));
    // A peer that went away (its process ended) is routine; anything else is worth a warning.
    if (why.code() == StatusCode::kUnavailable) {
      RUBATO_LOG_INFO(kLogSubsystem, "{}", peer.health.message());
    } else {
      RUBATO_LOG_WARN(kLogSubsystem, "{}", peer.health.message());
    }
    return true;
  };
  bool progressed = false;
  while (!peer.sending.empty()) {  // delivered in order
    Peer::SentReply& oldest = peer.sending.front();
    const Result<bool> sent = transport.Test(oldest.send);
    if (!sent.ok()) return fail(sent.status().WithContext("sending a reply"));
    if (!*sent) break;
    CountReplySent(peer, oldest.bytes, oldest.delta);
    peer.spare.push_back(std::move(oldest.buffer));
    peer.sending.pop_front();
    progressed = true;
  }
  switch (peer.phase) {
    case Peer::Phase::kIdle: {
      const std::span<std::byte> header = AsBytes(peer.header, sizeof(LayerPackHeader));
      const TransferOp receive =
          TransferOp::Recv(peer.rank, kPackHeaderTag, header.data(), header.size());
      const Result<TransferId> posted = transport.Post({&receive, 1});
      if (!posted.ok()) return fail(posted.status());
      peer.receive = *posted;
      peer.phase = Peer::Phase::kHeader;
      return true;
    }
    case Peer::Phase::kHeader: {
      const Result<bool> done = transport.Test(peer.receive);
      if (!done.ok()) return fail(done.status().WithContext("receiving a pack header"));
      if (!*done) return progressed;
      LayerPackHeader header;
      std::memcpy(&header, peer.header.data(), sizeof(header));
      if (std::memcmp(header.magic, kLayerPackMagic, sizeof(header.magic)) == 0 &&
          header.version != kLayerPackVersion) {
        return fail(UnsupportedError(
            "a KV pack of layer-pack version " + std::to_string(header.version) +
            ", this cache rank reads version " + std::to_string(kLayerPackVersion) +
            " (the inference rank runs another rubato version)"));
      }
      if (std::memcmp(header.magic, kLayerPackMagic, sizeof(header.magic)) != 0 ||
          header.kind != static_cast<uint8_t>(LayerPackKind::kKvPack) ||
          header.total_bytes < sizeof(LayerPackHeader) ||
          header.total_bytes > options_.max_pack_bytes) {
        return fail(DataLossError("a KV pack header with bad magic or kind, or announcing " +
                                  std::to_string(header.total_bytes) + " bytes (limit " +
                                  std::to_string(options_.max_pack_bytes) + ")"));
      }
      peer.body_bytes = header.total_bytes;
      const std::span<std::byte> body = AsBytes(peer.body, peer.body_bytes);
      const TransferOp receive = TransferOp::Recv(peer.rank, kPackTag, body.data(), body.size());
      const Result<TransferId> posted = transport.Post({&receive, 1});
      if (!posted.ok()) return fail(posted.status());
      peer.receive = *posted;
      peer.phase = Peer::Phase::kBody;
      CountReceived(peer, sizeof(LayerPackHeader));
      return true;
    }
    case Peer::Phase::kBody: {
      const Result<bool> done = transport.Test(peer.receive);
      if (!done.ok()) return fail(done.status().WithContext("receiving a KV pack"));
      if (!*done) return progressed;
      ++packs_received_;
      CountReceived(peer, peer.body_bytes);
      if (peer.sending.size() >= kMaxRepliesInFlight) {  // no room: wait for the oldest
        peer.phase = Peer::Phase::kReplyPending;
        peer.reply_wait_since = std::chrono::steady_clock::now();
        return true;
      }
      const Status replied = ProcessAndReply(peer);
      return replied.ok() ? true : fail(replied);
    }
    case Peer::Phase::kReplyPending: {
      if (peer.sending.size() < kMaxRepliesInFlight) {
        const Status replied = ProcessAndReply(peer);
        return replied.ok() ? true : fail(replied);
      }
      if (std::chrono::steady_clock::now() - peer.reply_wait_since > kReplySendTimeout) {
        return fail(DeadlineExceededError(
            "sending a reply: not delivered within " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::seconds>(kReplySendTimeout).count()) +
            " s while the next pack waited"));
      }
      return progressed;
    }
  }
  return progressed;
}

Status CacheService::ProcessAndReply(Peer& peer) {
  if (!peer.spare.empty()) {  // build into a delivered reply's buffer
    peer.reply = std::move(peer.spare.back());
    peer.spare.pop_back();
  }
  RUBATO_RETURN_IF_ERROR(ProcessPack(peer));
  Peer::SentReply& sent = peer.sending.emplace_back();
  sent.buffer = std::move(peer.reply);
  sent.bytes = peer.reply_bytes;
  sent.delta = peer.reply_delta;
  peer.reply.clear();
  std::byte* reply = AsBytes(sent.buffer, sent.bytes).data();
  // A delta reply's size is news to the peer: its header leaves first.
  const TransferOp sends[] = {
      TransferOp::Send(peer.rank, kReplyHeaderTag, reply, sizeof(LayerPackHeader)),
      TransferOp::Send(peer.rank, kReplyTag, reply, peer.reply_bytes)};
  const std::span<const TransferOp> posts = peer.reply_delta
                                                ? std::span<const TransferOp>(sends)
                                                : std::span<const TransferOp>(&sends[1], 1);
  const Result<TransferId> posted = peer.transport->Post(posts);
  if (!posted.ok()) {
    peer.sending.pop_back();
    return posted.status();
  }
  sent.send = *posted;
  ++replies_posted_;
  peer.phase = Peer::Phase::kIdle;
  return Status::Ok();
}

Status CacheService::ProcessPack(Peer& peer) {
  RUBATO_ASSIGN_OR_RETURN(const LayerPackView pack,
                          LayerPackView::Parse(AsBytes(peer.body, peer.body_bytes)));
  const std::string where = "KV pack of step " + std::to_string(pack.step()) + ", layers " +
                            std::to_string(pack.first_layer()) + "-" +
                            std::to_string(pack.first_layer() + pack.num_layers() - 1);
  std::vector<SessionInfo*> sessions;
  for (const LayerPackRequest& request : pack.requests()) {
    const auto found = sessions_.find(request.session_id);
    if (found == sessions_.end() || found->second.peer != peer.id) {
      return NotFoundError(where + ": session " + std::to_string(request.session_id) +
                           " is not open for this peer");
    }
    SessionInfo& session = found->second;
    if (pack.delta() && (session.selector->traits().partial_attention)) {
      return InvalidArgumentError(where + ": session " + std::to_string(request.session_id) +
                                  " asks for delta replies, its " +
                                  std::string(session.selector->name()) +
                                  " selector replies no rows");
    }
    const ReplyRange range =
        session.selector->ReplyRangeFor(session.spec, static_cast<int>(request.first_position),
                                        static_cast<int>(request.new_tokens));
    if (static_cast<int64_t>(request.reply_slots) != range.slots) {
      return InvalidArgumentError(where + ": session " + std::to_string(request.session_id) +
                                  " asks for " + std::to_string(request.reply_slots) +
                                  " reply rows per KV head, its selector gives " +
                                  std::to_string(range.slots));
    }
    if (static_cast<int64_t>(request.attention_queries) != range.attention_queries) {
      return InvalidArgumentError(
          where + ": session " + std::to_string(request.session_id) +
          " asks for the attention of " + std::to_string(request.attention_queries) +
          " queries, its selector gives " + std::to_string(range.attention_queries));
    }
    if (session.selector->traits().needs_query &&
        (range.slots > 0 || range.attention_queries > 0) && !pack.has_query()) {
      return InvalidArgumentError(where + ": " + std::string(session.selector->name()) +
                                  " session " + std::to_string(request.session_id) +
                                  " sent no query");
    }
    sessions.push_back(&session);
  }
  RUBATO_RETURN_IF_ERROR(store_.AppendKvPack(pack).WithContext(where));

  const auto selection_start = std::chrono::steady_clock::now();
  std::vector<KvHeadSelection> selections;
  selections.reserve(static_cast<size_t>(pack.num_layers()) * pack.batch());
  for (uint32_t layer_index = 0; layer_index < pack.num_layers(); ++layer_index) {
    for (uint32_t request = 0; request < pack.batch(); ++request) {
      SessionInfo& session = *sessions[request];
      RUBATO_ASSIGN_OR_RETURN(KvHeadSelection selection,
                              session.selector->Select(session.spec, store_, pack, layer_index,
                                                       request, session.state.get()));
      selections.push_back(std::move(selection));
    }
  }
  uint64_t written = 0;
  peer.reply_delta = pack.delta();
  if (pack.delta()) {
    RUBATO_ASSIGN_OR_RETURN(const auto deltas, SelectionDeltas(pack, sessions, selections));
    std::vector<LayerPackRequest> reply_requests;
    RUBATO_ASSIGN_OR_RETURN(peer.reply_bytes,
                            BuildDeltaReplyPack(store_, pack, deltas, reply_requests, {}));
    RUBATO_ASSIGN_OR_RETURN(written, BuildDeltaReplyPack(store_, pack, deltas, reply_requests,
                                                         AsBytes(peer.reply, peer.reply_bytes)));
  } else {
    LayerPackShape reply_shape = pack.shape();
    reply_shape.kind = LayerPackKind::kReplyPack;
    reply_shape.has_query = false;
    RUBATO_ASSIGN_OR_RETURN(peer.reply_bytes, ReplyPackBytes(reply_shape, pack.requests()));
    RUBATO_ASSIGN_OR_RETURN(
        written, BuildReplyPack(store_, pack, selections, AsBytes(peer.reply, peer.reply_bytes)));
  }
  if (written != peer.reply_bytes) {
    return InternalError(where + ": reply of " + std::to_string(written) + " bytes, expected " +
                         std::to_string(peer.reply_bytes));
  }
  const auto took = std::chrono::steady_clock::now() - selection_start;
  selection_nanoseconds_ +=
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count());
  if (selection_metric_ != nullptr && !sessions.empty()) {
    // A pack's sessions come from one client, so one selector.
    const Result<Histogram*> histogram =
        selection_metric_->WithLabels({std::string(sessions.front()->selector->name())});
    if (histogram.ok()) (*histogram)->Observe(std::chrono::duration<double>(took).count());
  }
  return Status::Ok();
}

Result<std::vector<std::vector<CompactDelta>>> CacheService::SelectionDeltas(
    const LayerPackView& pack, const std::vector<SessionInfo*>& sessions,
    const std::vector<KvHeadSelection>& selections) {
  const uint32_t kv_heads = pack.num_kv_heads();
  std::vector<std::vector<CompactDelta>> deltas;
  deltas.reserve(selections.size());
  for (uint32_t layer_index = 0; layer_index < pack.num_layers(); ++layer_index) {
    for (uint32_t request = 0; request < pack.batch(); ++request) {
      SessionInfo& session = *sessions[request];
      const uint32_t layer = pack.first_layer() + layer_index;
      if (session.slot_maps.empty()) {
        RUBATO_ASSIGN_OR_RETURN(const SessionShape shape,
                                store_.GetSessionShape(pack.requests()[request].session_id));
        session.slot_maps.assign(size_t{shape.num_layers} * kv_heads,
                                 CompactSlotMap(static_cast<int>(session.pool_capacity)));
      }
      // The inference rank asks for a full reply when its pools are empty (a new or reset one).
      const bool reset = pack.requests()[request].delta_reset != 0;
      const KvHeadSelection& selection = selections[deltas.size()];
      std::vector<CompactDelta>& heads = deltas.emplace_back();
      for (uint32_t h = 0; h < kv_heads; ++h) {
        CompactSlotMap& map = session.slot_maps.at(size_t{layer} * kv_heads + h);
        RUBATO_ASSIGN_OR_RETURN(CompactDelta delta,
                                reset ? map.Reset(selection[h]) : map.Update(selection[h]));
        heads.push_back(std::move(delta));
      }
    }
  }
  return deltas;
}

}  // namespace rubato
