// The in-process Transport: matching of sends and receives across the ranks of a LoopbackHub
// (loopback_transport.h). All state is in LoopbackHubState behind one mutex; a condition
// variable wakes Wait when another rank's Post completes one of its ops.
#include "transport/loopback_transport.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "transport/transfer_validation.h"

namespace rubato::transport {
namespace {

constexpr int kMaxWorldSize = 1 << 16;

// One Post's ops: how many have not finished yet and the first failure.
struct LoopbackGroup {
  size_t ops_pending = 0;
  Status first_error;
  // (receiver, sender, tag) of every channel this group has an op queued in.
  std::vector<std::tuple<int, int, uint64_t>> channels;
};

// An op waiting for its counterpart: `owner` posted `op` as part of `group`.
struct QueuedOp {
  int owner = 0;
  TransferOp op;
  std::shared_ptr<LoopbackGroup> group;
};

// The messages from `sender` to `receiver` with one tag: unmatched sends or unmatched
// receives, oldest first (at most one of the two queues is non-empty).
struct Channel {
  std::deque<QueuedOp> sends;
  std::deque<QueuedOp> recvs;
};

enum class EndpointState { kNotCreated, kOpen, kClosed };

struct RankState {
  EndpointState endpoint = EndpointState::kNotCreated;
  TransportStats stats;
  TransferId next_id = 1;
  std::map<TransferId, std::shared_ptr<LoopbackGroup>> groups;
};

}  // namespace

struct LoopbackHubState {
  explicit LoopbackHubState(int world) : world_size(world), ranks(static_cast<size_t>(world)) {}

  // Finishes one op of `group` with `status`; wakes every Wait.
  void FinishOp(LoopbackGroup& group, const Status& status) {
    if (!status.ok() && group.first_error.ok()) group.first_error = status;
    --group.ops_pending;
    changed.notify_all();
  }

  // Removes `group`'s ops that still wait in a channel (they never touched their buffers).
  void Unqueue(const std::shared_ptr<LoopbackGroup>& group) {
    for (const auto& key : group->channels) {
      auto it = channels.find(key);
      if (it == channels.end()) continue;
      for (auto* queue : {&it->second.sends, &it->second.recvs}) {
        std::erase_if(*queue, [&](const QueuedOp& q) { return q.group == group; });
      }
      if (it->second.sends.empty() && it->second.recvs.empty()) channels.erase(it);
    }
    group->channels.clear();
  }

  // Copies `send` into `recv` (sizes must match exactly) and finishes both.
  void Match(const QueuedOp& send, const QueuedOp& recv) {
    if (send.op.bytes != recv.op.bytes) {
      ranks[static_cast<size_t>(recv.owner)].stats.transfers_failed++;
      FinishOp(*recv.group,
               DataLossError(fmt::format(
                   "loopback: receive from peer {}, tag {}: the message has {} bytes but the "
                   "receive buffer has {} bytes (sizes must match exactly)",
                   send.owner, send.op.tag, send.op.bytes, recv.op.bytes)));
      // The sender cannot know the receiver's size (as with UCX): its send completes.
      FinishOp(*send.group, Status::Ok());
      return;
    }
    if (send.op.bytes > 0) std::memcpy(recv.op.data, send.op.data, send.op.bytes);
    ranks[static_cast<size_t>(send.owner)].stats.bytes_sent += send.op.bytes;
    ranks[static_cast<size_t>(recv.owner)].stats.bytes_received += recv.op.bytes;
    FinishOp(*send.group, Status::Ok());
    FinishOp(*recv.group, Status::Ok());
  }

  // Matches `op` with the oldest counterpart in its channel, or queues it.
  void Submit(int owner, const TransferOp& op, const std::shared_ptr<LoopbackGroup>& group) {
    const bool send = op.direction == TransferOp::Direction::kSend;
    if (ranks[static_cast<size_t>(op.peer)].endpoint == EndpointState::kClosed) {
      ranks[static_cast<size_t>(owner)].stats.transfers_failed++;
      FinishOp(*group, UnavailableError(fmt::format(
                           "loopback: rank {} ({}): the peer's endpoint is closed", owner,
                           DescribeOp(op))));
      return;
    }
    const auto key = send ? std::make_tuple(op.peer, owner, op.tag)
                          : std::make_tuple(owner, op.peer, op.tag);
    Channel& channel = channels[key];
    QueuedOp queued{owner, op, group};
    auto& counterparts = send ? channel.recvs : channel.sends;
    if (counterparts.empty()) {
      (send ? channel.sends : channel.recvs).push_back(std::move(queued));
      group->channels.push_back(key);
      return;
    }
    QueuedOp other = std::move(counterparts.front());
    counterparts.pop_front();
    if (send) {
      Match(queued, other);
    } else {
      Match(other, queued);
    }
    if (channel.sends.empty() && channel.recvs.empty()) channels.erase(key);
  }

  // Fails every queued op of another rank whose peer is `closed_rank`.
  void FailOpsWithPeer(int closed_rank) {
    for (auto it = channels.begin(); it != channels.end();) {
      for (auto* queue : {&it->second.sends, &it->second.recvs}) {
        for (auto q = queue->begin(); q != queue->end();) {
          if (q->op.peer != closed_rank) {
            ++q;
            continue;
          }
          ranks[static_cast<size_t>(q->owner)].stats.transfers_failed++;
          FinishOp(*q->group, UnavailableError(fmt::format(
                                  "loopback: rank {} ({}): the peer closed its endpoint with "
                                  "the transfer pending",
                                  q->owner, DescribeOp(q->op))));
          q = queue->erase(q);
        }
      }
      it = (it->second.sends.empty() && it->second.recvs.empty()) ? channels.erase(it)
                                                                   : std::next(it);
    }
  }

  std::mutex mutex;
  std::condition_variable changed;  // an op finished
  const int world_size;
  std::vector<RankState> ranks;  // [world_size]
  std::map<std::tuple<int, int, uint64_t>, Channel> channels;  // (receiver, sender, tag)
};

namespace {

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackHubState> hub, int rank)
      : hub_(std::move(hub)), rank_(rank) {}

  ~LoopbackTransport() override {
    std::lock_guard lock(hub_->mutex);
    RankState& me = Me();
    for (auto& [id, group] : me.groups) hub_->Unqueue(group);
    me.groups.clear();
    me.endpoint = EndpointState::kClosed;
    hub_->FailOpsWithPeer(rank_);
  }

  std::string_view BackendName() const override { return "loopback"; }
  int Rank() const override { return rank_; }
  int WorldSize() const override { return hub_->world_size; }
  bool SupportsMemory(MemoryKind memory) const override { return memory == MemoryKind::kHost; }

  Result<TransferId> Post(std::span<const TransferOp> ops) override {
    RUBATO_RETURN_IF_ERROR(ValidateOps(*this, ops));
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].ready_event != nullptr) {
        // No CUDA here to wait on the event with: copying at once could read unwritten bytes.
        return UnsupportedError(fmt::format(
            "loopback: Post op {} of {} ({}): ready_event is not supported by the loopback "
            "transport; synchronize the event before Post",
            i, ops.size(), DescribeOp(ops[i])));
      }
    }
    std::lock_guard lock(hub_->mutex);
    auto group = std::make_shared<LoopbackGroup>();
    group->ops_pending = ops.size();
    const TransferId id = Me().next_id++;
    Me().groups.emplace(id, group);
    for (const TransferOp& op : ops) hub_->Submit(rank_, op, group);
    return id;
  }

  Result<bool> Test(TransferId id) override {
    std::lock_guard lock(hub_->mutex);
    RUBATO_ASSIGN_OR_RETURN(auto group, FindGroup(id));
    if (group->ops_pending > 0 && group->first_error.ok()) return false;
    return Release(id, group);
  }

  Status Wait(TransferId id, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock lock(hub_->mutex);
    RUBATO_ASSIGN_OR_RETURN(auto group, FindGroup(id));
    const bool finished = hub_->changed.wait_until(lock, deadline, [&] {
      return group->ops_pending == 0 || !group->first_error.ok();
    });
    if (!finished) {
      return DeadlineExceededError(fmt::format(
          "loopback: rank {}: transfer {} not done after {} ms ({} op(s) still waiting for their "
          "peer); Wait again or Cancel it",
          rank_, id, timeout.count(), group->ops_pending));
    }
    Result<bool> done = Release(id, group);
    return done.status();
  }

  void Cancel(TransferId id) override {
    std::lock_guard lock(hub_->mutex);
    auto it = Me().groups.find(id);
    if (it == Me().groups.end()) return;
    hub_->Unqueue(it->second);
    Me().groups.erase(it);
  }

  TransportStats Stats() const override {
    std::lock_guard lock(hub_->mutex);
    return hub_->ranks[static_cast<size_t>(rank_)].stats;
  }

 private:
  RankState& Me() { return hub_->ranks[static_cast<size_t>(rank_)]; }

  Result<std::shared_ptr<LoopbackGroup>> FindGroup(TransferId id) {
    auto it = Me().groups.find(id);
    if (it == Me().groups.end()) {
      return InvalidArgumentError(fmt::format(
          "loopback: rank {}: unknown transfer id {} (never posted, or already reported done, "
          "failed or cancelled)",
          rank_, id));
    }
    return it->second;
  }

  // The group finished or failed: forget it (a failed group's other ops are taken back).
  Result<bool> Release(TransferId id, const std::shared_ptr<LoopbackGroup>& group) {
    hub_->Unqueue(group);
    Me().groups.erase(id);
    if (!group->first_error.ok()) return group->first_error;
    return true;
  }

  std::shared_ptr<LoopbackHubState> hub_;
  const int rank_;
};

}  // namespace

LoopbackHub::LoopbackHub(std::shared_ptr<LoopbackHubState> state) : state_(std::move(state)) {}

Result<std::unique_ptr<LoopbackHub>> LoopbackHub::Create(int world_size) {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return InvalidArgumentError(fmt::format("loopback: world_size {} is out of range [1, {}]",
                                            world_size, kMaxWorldSize));
  }
  return std::unique_ptr<LoopbackHub>(
      new LoopbackHub(std::make_shared<LoopbackHubState>(world_size)));
}

int LoopbackHub::WorldSize() const { return state_->world_size; }

Result<std::unique_ptr<Transport>> LoopbackHub::Endpoint(int rank) {
  if (rank < 0 || rank >= state_->world_size) {
    return InvalidArgumentError(fmt::format("loopback: rank {} is out of range [0, {})", rank,
                                            state_->world_size));
  }
  std::lock_guard lock(state_->mutex);
  RankState& state = state_->ranks[static_cast<size_t>(rank)];
  if (state.endpoint == EndpointState::kOpen) {
    return FailedPreconditionError(fmt::format(
        "loopback: rank {} already has an endpoint; destroy it before asking for another", rank));
  }
  state.endpoint = EndpointState::kOpen;
  return std::unique_ptr<Transport>(new LoopbackTransport(state_, rank));
}

}  // namespace rubato::transport
