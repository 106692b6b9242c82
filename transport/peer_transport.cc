// The in-process device transport's matching half (peer_transport.h): channels of queued sends
// and receives per (sender, receiver, tag), groups per rank, all behind the hub's mutex; the
// bytes move by the PeerCopier when the second op of a pair is posted.
#include "transport/peer_transport.h"

#include <fmt/format.h>

#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "transport/transfer_validation.h"

namespace rubato::transport {
namespace {

constexpr int kMaxWorldSize = 1 << 16;

// One copy, shared by the send and the receive it completes; its mark goes back to the copier
// when neither group needs it any more.
struct CopyRecord {
  PeerCopier::Mark done = nullptr;
  int users = 0;
};

struct PeerOp {
  TransferOp op;
  PeerCopier::Mark posted = nullptr;  // until the op is matched or dropped
  bool queued = true;                 // waiting in its channel for the peer's op
  std::shared_ptr<CopyRecord> copy;   // once matched (none for 0 bytes or a size mismatch)
};

// One Post's ops.
struct PeerGroup {
  std::vector<PeerOp> ops;
  size_t queued = 0;  // ops still waiting for their peer
  Status first_error;
};

// An op waiting for its counterpart: op `index` of `group`, posted by `owner`.
struct QueuedRef {
  int owner = 0;
  std::shared_ptr<PeerGroup> group;
  size_t index = 0;
  PeerOp& Op() const { return group->ops[index]; }
};

// Unmatched sends or unmatched receives of one (sender, receiver, tag), oldest first (at most
// one of the two is non-empty).
struct Channel {
  std::deque<QueuedRef> sends;
  std::deque<QueuedRef> recvs;
};
using ChannelKey = std::tuple<int, int, uint64_t>;  // (sender, receiver, tag)

enum class EndpointState { kNotCreated, kOpen, kClosed };

struct RankState {
  EndpointState endpoint = EndpointState::kNotCreated;
  TransportStats stats;
  TransferId next_id = 1;
  std::map<TransferId, std::shared_ptr<PeerGroup>> groups;
};

ChannelKey KeyOf(int owner, const TransferOp& op) {
  return op.direction == TransferOp::Direction::kSend ? ChannelKey{owner, op.peer, op.tag}
                                                      : ChannelKey{op.peer, owner, op.tag};
}

}  // namespace

struct PeerHubState {
  PeerHubState(int world, std::unique_ptr<PeerCopier> device)
      : world_size(world), ranks(static_cast<size_t>(world)), copier(std::move(device)) {}

  RankState& Rank(int rank) { return ranks[static_cast<size_t>(rank)]; }

  void Fail(int owner, PeerGroup& group, Status why) {
    if (group.first_error.ok()) {
      group.first_error = std::move(why);
      ++Rank(owner).stats.transfers_failed;
    }
  }

  // Drops what `op` holds of the copier: its posted mark, its share of the copy.
  void Drop(PeerOp& op) {
    if (op.posted != nullptr) copier->Recycle(op.posted);
    op.posted = nullptr;
    if (op.copy != nullptr && --op.copy->users == 0) copier->Recycle(op.copy->done);
    op.copy.reset();
  }

  // Takes `ref` out of its channel (it will never be matched).
  void Unqueue(const QueuedRef& ref) {
    PeerOp& op = ref.Op();
    if (!op.queued) return;
    const auto it = channels.find(KeyOf(ref.owner, op.op));
    if (it != channels.end()) {
      for (auto* queue : {&it->second.sends, &it->second.recvs}) {
        std::erase_if(*queue, [&](const QueuedRef& q) {
          return q.group == ref.group && q.index == ref.index;
        });
      }
      if (it->second.sends.empty() && it->second.recvs.empty()) channels.erase(it);
    }
    op.queued = false;
    --ref.group->queued;
  }

  // Forgets a group of `owner`: unqueued, each copy it issued waited for (its buffers are the
  // caller's again once this returns), marks back to the copier.
  void Release(int owner, const std::shared_ptr<PeerGroup>& group) {
    for (size_t i = 0; i < group->ops.size(); ++i) {
      Unqueue({owner, group, i});
      PeerOp& op = group->ops[i];
      if (op.copy != nullptr) copier->Synchronize(op.copy->done);
      Drop(op);
    }
  }

  // Pairs a queued send with a queued receive: issues the copy (or fails the receive on a size
  // mismatch) and takes both out of their queue.
  void Match(const QueuedRef& send, const QueuedRef& recv) {
    PeerOp& s = send.Op();
    PeerOp& r = recv.Op();
    s.queued = r.queued = false;
    --send.group->queued;
    --recv.group->queued;
    if (s.op.bytes != r.op.bytes) {
      Fail(recv.owner, *recv.group,
           DataLossError(fmt::format(
               "{}: rank {}: receive from peer {}, tag {}: the message has {} bytes but the "
               "receive buffer has {} bytes (sizes must match exactly)",
               copier->BackendName(), recv.owner, send.owner, s.op.tag, s.op.bytes, r.op.bytes)));
      // The sender cannot know the receiver's size (as with NCCL, UCX): its send completes.
    } else if (s.op.bytes > 0) {
      Result<PeerCopier::Mark> done =
          copier->Copy(send.owner, s.op, s.posted, recv.owner, r.op, r.posted);
      if (done.ok()) {
        auto record = std::make_shared<CopyRecord>(CopyRecord{*done, 2});
        s.copy = record;
        r.copy = record;
      } else {
        Fail(send.owner, *send.group, done.status());
        Fail(recv.owner, *recv.group, done.status());
      }
    }
    // The copy waited on the posted marks when it was issued: they may be reused now.
    copier->Recycle(s.posted);
    copier->Recycle(r.posted);
    s.posted = r.posted = nullptr;
  }

  // Matches op `index` of `group` with the oldest counterpart in its channel, or queues it.
  void Submit(int owner, const std::shared_ptr<PeerGroup>& group, size_t index) {
    const TransferOp& op = group->ops[index].op;
    const bool send = op.direction == TransferOp::Direction::kSend;
    const ChannelKey key = KeyOf(owner, op);
    Channel& channel = channels[key];
    QueuedRef mine{owner, group, index};
    auto& counterparts = send ? channel.recvs : channel.sends;
    if (counterparts.empty()) {
      (send ? channel.sends : channel.recvs).push_back(std::move(mine));
      return;
    }
    QueuedRef other = std::move(counterparts.front());
    counterparts.pop_front();
    if (channel.sends.empty() && channel.recvs.empty()) channels.erase(key);
    if (send) {
      Match(mine, other);
    } else {
      Match(other, mine);
    }
  }

  // Fails every queued op of another rank whose peer is `closed`.
  void FailOpsWithPeer(int closed) {
    std::vector<QueuedRef> orphans;
    for (auto& [key, channel] : channels) {
      for (auto* queue : {&channel.sends, &channel.recvs}) {
        for (const QueuedRef& q : *queue) {
          if (q.Op().op.peer == closed) orphans.push_back(q);
        }
      }
    }
    for (const QueuedRef& q : orphans) {
      Unqueue(q);
      Fail(q.owner, *q.group,
           UnavailableError(fmt::format("{}: rank {} ({}): the peer closed its endpoint with "
                                        "the transfer pending",
                                        copier->BackendName(), q.owner, DescribeOp(q.Op().op))));
      Drop(q.Op());
    }
  }

  std::mutex mutex;
  const int world_size;
  std::vector<RankState> ranks;  // [world_size]
  std::map<ChannelKey, Channel> channels;
  std::unique_ptr<PeerCopier> copier;
};

namespace {

class PeerTransport final : public StreamOrderedTransport {
 public:
  PeerTransport(std::shared_ptr<PeerHubState> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  ~PeerTransport() override {
    std::lock_guard lock(hub_->mutex);
    RankState& me = hub_->Rank(rank_);
    for (auto& [id, group] : me.groups) hub_->Release(rank_, group);
    me.groups.clear();
    me.endpoint = EndpointState::kClosed;
    hub_->FailOpsWithPeer(rank_);
  }

  std::string_view BackendName() const override { return hub_->copier->BackendName(); }
  int Rank() const override { return rank_; }
  int WorldSize() const override { return hub_->world_size; }
  bool SupportsMemory(MemoryKind memory) const override {
    return hub_->copier->SupportsMemory(memory);
  }

  Result<TransferId> Post(std::span<const TransferOp> ops) override {
    return PostOnStream(ops, nullptr);
  }

  Result<TransferId> PostOnStream(std::span<const TransferOp> ops, void* stream) override {
    RUBATO_RETURN_IF_ERROR(ValidateOps(*this, ops));
    std::lock_guard lock(hub_->mutex);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (hub_->Rank(ops[i].peer).endpoint == EndpointState::kClosed) {
        return UnavailableError(
            fmt::format("{}: rank {}: Post op {} of {} ({}): the peer's "
                        "endpoint is closed",
                        BackendName(), rank_, i, ops.size(), DescribeOp(ops[i])));
      }
    }
    auto group = std::make_shared<PeerGroup>();
    group->ops.resize(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      Result<PeerCopier::Mark> posted = hub_->copier->MarkPosted(rank_, ops[i], stream);
      if (!posted.ok()) {
        for (size_t j = 0; j < i; ++j) hub_->copier->Recycle(group->ops[j].posted);
        return posted.status();
      }
      group->ops[i].op = ops[i];
      group->ops[i].posted = *posted;
    }
    group->queued = ops.size();
    const TransferId id = hub_->Rank(rank_).next_id++;
    hub_->Rank(rank_).groups.emplace(id, group);
    for (size_t i = 0; i < ops.size(); ++i) hub_->Submit(rank_, group, i);
    return id;
  }

  Result<bool> Test(TransferId id) override {
    std::lock_guard lock(hub_->mutex);
    RUBATO_ASSIGN_OR_RETURN(auto group, FindGroup(id));
    if (!group->first_error.ok()) return Finish(id, group);
    if (group->queued > 0) return false;
    for (PeerOp& op : group->ops) {
      if (op.copy == nullptr) continue;
      Result<bool> passed = hub_->copier->Passed(op.copy->done);
      if (!passed.ok()) {
        hub_->Fail(rank_, *group, passed.status());
        return Finish(id, group);
      }
      if (!*passed) return false;
    }
    return Finish(id, group);
  }

  Status Wait(TransferId id, std::chrono::milliseconds timeout) override {
    return WaitBySpinning(*this, id, timeout);
  }

  void Cancel(TransferId id) override {
    std::lock_guard lock(hub_->mutex);
    auto it = hub_->Rank(rank_).groups.find(id);
    if (it == hub_->Rank(rank_).groups.end()) return;
    hub_->Release(rank_, it->second);
    hub_->Rank(rank_).groups.erase(it);
  }

  Status StreamWait(TransferId id, void* stream) override {
    std::lock_guard lock(hub_->mutex);
    RUBATO_ASSIGN_OR_RETURN(auto group, FindGroup(id));
    RUBATO_RETURN_IF_ERROR(group->first_error);
    for (size_t i = 0; i < group->ops.size(); ++i) {
      const PeerOp& op = group->ops[i];
      if (op.queued) {
        return FailedPreconditionError(fmt::format(
            "{}: rank {}: StreamWait on transfer {}: op {} ({}) is not matched yet (the peer has "
            "not posted its side); post the peer's side first, or Wait on the host",
            BackendName(), rank_, id, i, DescribeOp(op.op)));
      }
    }
    for (const PeerOp& op : group->ops) {
      if (op.copy != nullptr) {
        RUBATO_RETURN_IF_ERROR(hub_->copier->StreamWait(rank_, op.copy->done, stream));
      }
    }
    return Status::Ok();
  }

  TransportStats Stats() const override {
    std::lock_guard lock(hub_->mutex);
    return hub_->Rank(rank_).stats;
  }

 private:
  Result<std::shared_ptr<PeerGroup>> FindGroup(TransferId id) {
    auto it = hub_->Rank(rank_).groups.find(id);
    if (it == hub_->Rank(rank_).groups.end()) {
      return InvalidArgumentError(fmt::format(
          "{}: rank {}: unknown transfer id {} (never posted, or already reported done, failed "
          "or cancelled)",
          BackendName(), rank_, id));
    }
    return it->second;
  }

  // The group completed or failed: counts it and forgets it.
  Result<bool> Finish(TransferId id, const std::shared_ptr<PeerGroup>& group) {
    if (group->first_error.ok()) {
      TransportStats& stats = hub_->Rank(rank_).stats;
      for (const PeerOp& op : group->ops) {
        (op.op.direction == TransferOp::Direction::kSend ? stats.bytes_sent
                                                         : stats.bytes_received) += op.op.bytes;
      }
    }
    hub_->Release(rank_, group);
    hub_->Rank(rank_).groups.erase(id);
    if (!group->first_error.ok()) return group->first_error;
    return true;
  }

  std::shared_ptr<PeerHubState> hub_;
  const int rank_;
};

}  // namespace

PeerHub::PeerHub(std::shared_ptr<PeerHubState> state) : state_(std::move(state)) {}

Result<std::unique_ptr<PeerHub>> PeerHub::Create(int world_size,
                                                 std::unique_ptr<PeerCopier> copier) {
  if (copier == nullptr) return InvalidArgumentError("peer hub: no copier given");
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return InvalidArgumentError(fmt::format("{}: world_size {} is out of range [1, {}]",
                                            copier->BackendName(), world_size, kMaxWorldSize));
  }
  return std::unique_ptr<PeerHub>(
      new PeerHub(std::make_shared<PeerHubState>(world_size, std::move(copier))));
}

int PeerHub::WorldSize() const { return state_->world_size; }

Result<std::unique_ptr<StreamOrderedTransport>> PeerHub::Endpoint(int rank) {
  if (rank < 0 || rank >= state_->world_size) {
    return InvalidArgumentError(fmt::format("{}: rank {} is out of range [0, {})",
                                            state_->copier->BackendName(), rank,
                                            state_->world_size));
  }
  std::lock_guard lock(state_->mutex);
  RankState& state = state_->Rank(rank);
  if (state.endpoint == EndpointState::kOpen) {
    return FailedPreconditionError(
        fmt::format("{}: rank {} already has an endpoint; destroy it before asking for another",
                    state_->copier->BackendName(), rank));
  }
  state.endpoint = EndpointState::kOpen;
  return std::unique_ptr<StreamOrderedTransport>(new PeerTransport(state_, rank));
}

}  // namespace rubato::transport
