// Device packs over the stream-ordered paths; see bench/transport_device.h, and
// docs/transport.md "The transport benchmark" for what is measured and how. Every timing is the
// host clock around a batch of rounds enqueued without host waits in between (except the *_post
// series, which wait on the host per transfer, as a caller of Post / Wait does).
#include "bench/transport_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "kernels/cuda/cuda_status.h"
#include "transport/cuda_peer_transport.h"
#include "transport/nccl_transport.h"

namespace rubato::bench {
namespace {

using transport::MemoryKind;
using transport::NcclTransport;
using transport::StreamOrderedTransport;
using transport::TransferId;
using transport::TransferOp;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

constexpr std::chrono::milliseconds kWait{60000};

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Rounds per size: about 1 GiB moved, within [4, max_rounds].
int Rounds(size_t bytes, int max_rounds) {
  return static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / std::max<size_t>(bytes, 1), 4,
                                             static_cast<size_t>(max_rounds)));
}

// A device buffer and a non-blocking stream on one device.
struct DeviceSide {
  int device = 0;
  void* data = nullptr;
  cudaStream_t stream = nullptr;
  DeviceSide() = default;
  DeviceSide(const DeviceSide&) = delete;
  DeviceSide& operator=(const DeviceSide&) = delete;
  ~DeviceSide() {
    (void)cudaSetDevice(device);
    if (data != nullptr) (void)cudaFree(data);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
  Status Init(int on, size_t bytes) {
    device = on;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "selecting a device");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, std::max<size_t>(bytes, 1)),
                                "allocating " + std::to_string(bytes) + " bytes");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(data, 1, std::max<size_t>(bytes, 1)), "filling");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                "creating a stream");
    return Status::Ok();
  }
  Status Sync() const {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "selecting a device");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "synchronizing");
    return Status::Ok();
  }
};

// Runs body(rank) on two threads that start together; the first error.
Status OnTwoThreads(const std::function<Status(int, std::barrier<>&)>& body) {
  std::barrier<> start(2);
  Status statuses[2];
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) threads[r] = std::thread([&, r] { statuses[r] = body(r, start); });
  for (std::thread& thread : threads) thread.join();
  return statuses[0].ok() ? statuses[1] : statuses[0];
}

// ---- cudaMemcpyPeerAsync between devices 0 and 1 -------------------------------------------

Status MemcpyPeer(size_t bytes, int rounds, Json& point) {
  DeviceSide a, b;
  RUBATO_RETURN_IF_ERROR(a.Init(0, bytes));
  RUBATO_RETURN_IF_ERROR(b.Init(1, bytes));
  const auto there = [&] { return cudaMemcpyPeerAsync(b.data, 1, a.data, 0, bytes, b.stream); };
  const auto back = [&] { return cudaMemcpyPeerAsync(a.data, 0, b.data, 1, bytes, b.stream); };
  for (int i = 0; i < 2; ++i) {
    RUBATO_CUDA_RETURN_IF_ERROR(there(), "warm-up copy");
  }
  RUBATO_RETURN_IF_ERROR(b.Sync());
  auto start = Clock::now();
  for (int i = 0; i < rounds; ++i) {
    RUBATO_CUDA_RETURN_IF_ERROR(there(), "cudaMemcpyPeerAsync");
    RUBATO_CUDA_RETURN_IF_ERROR(back(), "cudaMemcpyPeerAsync");
  }
  RUBATO_RETURN_IF_ERROR(b.Sync());
  point["memcpy_peer_one_way_us"] = Since(start) * 1e6 / (2.0 * rounds);
  start = Clock::now();
  for (int i = 0; i < rounds; ++i) RUBATO_CUDA_RETURN_IF_ERROR(there(), "cudaMemcpyPeerAsync");
  RUBATO_RETURN_IF_ERROR(b.Sync());
  point["memcpy_peer_gbps"] = static_cast<double>(bytes) * rounds / Since(start) / 1e9;
  return Status::Ok();
}

// ---- NCCL: Enqueue, a captured graph, Post / Wait -----------------------------------------

// blocking: posts on the blocking data communicator (the default) or the non-blocking one.
Result<std::array<std::unique_ptr<NcclTransport>, 2>> MakeNccl(bool blocking) {
  RUBATO_ASSIGN_OR_RETURN(std::string id, NcclTransport::NewUniqueId());
  std::array<std::unique_ptr<NcclTransport>, 2> ranks;
  RUBATO_RETURN_IF_ERROR(OnTwoThreads([&](int r, std::barrier<>&) -> Status {
    RUBATO_ASSIGN_OR_RETURN(ranks[r], NcclTransport::Create({.unique_id = id,
                                                             .rank = r,
                                                             .world_size = 2,
                                                             .device = r,
                                                             .blocking_data_comm = blocking}));
    return Status::Ok();
  }));
  return ranks;
}

// One ping-pong round of rank r on its stream: rank 0 sends then receives, rank 1 the reverse
// (into and out of one buffer).
Status EnqueueRound(NcclTransport& nccl, int r, DeviceSide& side, size_t bytes) {
  const TransferOp send = TransferOp::Send(1 - r, 1, side.data, bytes, MemoryKind::kCuda);
  const TransferOp recv = TransferOp::Recv(1 - r, 1, side.data, bytes, MemoryKind::kCuda);
  RUBATO_RETURN_IF_ERROR(nccl.Enqueue({r == 0 ? &send : &recv, 1}, side.stream));
  return nccl.Enqueue({r == 0 ? &recv : &send, 1}, side.stream);
}

Status NcclSeries(std::array<std::unique_ptr<NcclTransport>, 2>& nccl, size_t bytes, int rounds,
                  const DeviceBenchOptions& options, Json& point) {
  double seconds[4] = {};  // per one-way hop: stream, graph, post; all sends (rank 0's clock)
  RUBATO_RETURN_IF_ERROR(OnTwoThreads([&](int r, std::barrier<>& start) -> Status {
    DeviceSide side;
    RUBATO_RETURN_IF_ERROR(side.Init(r, bytes));
    NcclTransport& me = *nccl[r];
    RUBATO_RETURN_IF_ERROR(EnqueueRound(me, r, side, bytes));  // warm-up
    RUBATO_RETURN_IF_ERROR(side.Sync());
    // Stream-ordered ping-pong: every round enqueued, one host wait at the end.
    start.arrive_and_wait();
    auto begin = Clock::now();
    for (int i = 0; i < rounds; ++i) RUBATO_RETURN_IF_ERROR(EnqueueRound(me, r, side, bytes));
    RUBATO_RETURN_IF_ERROR(side.Sync());
    if (r == 0) seconds[0] = Since(begin) / (2.0 * rounds);
    // The same rounds captured in one graph, replayed.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaStreamBeginCapture(side.stream, cudaStreamCaptureModeThreadLocal),
        "beginning a capture");
    Status captured = Status::Ok();
    for (int i = 0; i < options.graph_rounds && captured.ok(); ++i) {
      captured = EnqueueRound(me, r, side, bytes);
    }
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(side.stream, &graph), "ending a capture");
    RUBATO_RETURN_IF_ERROR(captured);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0), "instantiating");
    const int launches = std::max(1, rounds / options.graph_rounds);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, side.stream), "warm-up launch");
    RUBATO_RETURN_IF_ERROR(side.Sync());
    start.arrive_and_wait();
    begin = Clock::now();
    for (int i = 0; i < launches; ++i) {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, side.stream), "launching");
    }
    RUBATO_RETURN_IF_ERROR(side.Sync());
    if (r == 0) seconds[1] = Since(begin) / (2.0 * launches * options.graph_rounds);
    (void)cudaGraphExecDestroy(exec);
    (void)cudaGraphDestroy(graph);
    // Post / Wait per transfer: what a caller that waits on the host sees.
    const TransferOp send = TransferOp::Send(1 - r, 2, side.data, bytes, MemoryKind::kCuda);
    const TransferOp recv = TransferOp::Recv(1 - r, 2, side.data, bytes, MemoryKind::kCuda);
    start.arrive_and_wait();
    begin = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      for (const TransferOp* op : {r == 0 ? &send : &recv, r == 0 ? &recv : &send}) {
        RUBATO_ASSIGN_OR_RETURN(const TransferId id, me.PostOnStream({op, 1}, side.stream));
        RUBATO_RETURN_IF_ERROR(me.Wait(id, kWait));
      }
    }
    if (r == 0) seconds[2] = Since(begin) / (2.0 * rounds);
    // Bandwidth: rank 0 sends `rounds` times, nothing waits in between.
    start.arrive_and_wait();
    begin = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      RUBATO_RETURN_IF_ERROR(me.Enqueue({r == 0 ? &send : &recv, 1}, side.stream));
    }
    RUBATO_RETURN_IF_ERROR(side.Sync());
    start.arrive_and_wait();  // rank 0's clock stops when the receiver has everything too
    if (r == 0) seconds[3] = Since(begin);
    return Status::Ok();
  }));
  point["nccl_stream_one_way_us"] = seconds[0] * 1e6;
  point["nccl_graph_one_way_us"] = seconds[1] * 1e6;
  point["nccl_post_one_way_us"] = seconds[2] * 1e6;
  point["nccl_gbps"] = static_cast<double>(bytes) * rounds / seconds[3] / 1e9;
  return Status::Ok();
}

// The stream-ordered ping-pong alone on a transport that posts on its non-blocking
// communicator: what every post cost before the blocking data communicator.
Status NcclNonBlockingSeries(std::array<std::unique_ptr<NcclTransport>, 2>& nccl, size_t bytes,
                             int rounds, Json& point) {
  double seconds = 0;
  RUBATO_RETURN_IF_ERROR(OnTwoThreads([&](int r, std::barrier<>& start) -> Status {
    DeviceSide side;
    RUBATO_RETURN_IF_ERROR(side.Init(r, bytes));
    RUBATO_RETURN_IF_ERROR(EnqueueRound(*nccl[r], r, side, bytes));  // warm-up
    RUBATO_RETURN_IF_ERROR(side.Sync());
    start.arrive_and_wait();
    const auto begin = Clock::now();
    for (int i = 0; i < rounds; ++i) RUBATO_RETURN_IF_ERROR(EnqueueRound(*nccl[r], r, side, bytes));
    RUBATO_RETURN_IF_ERROR(side.Sync());
    if (r == 0) seconds = Since(begin) / (2.0 * rounds);
    return Status::Ok();
  }));
  point["nccl_nonblocking_stream_one_way_us"] = seconds * 1e6;
  return Status::Ok();
}

// ---- cuda_peer ----------------------------------------------------------------------------

// Stream-ordered ping-pong and pipelined bandwidth, both endpoints driven from this thread:
// the receive of each direction is posted before its send, so every pair matches when the send
// is posted and StreamWait can order the next hop on the GPU. Then Post / Wait on two threads.
Status CudaPeerSeries(std::array<int, 2> devices, size_t bytes, int rounds, Json& point) {
  RUBATO_ASSIGN_OR_RETURN(auto hub, transport::CreateCudaPeerHub(devices));
  std::array<std::unique_ptr<StreamOrderedTransport>, 2> ranks;
  for (int r = 0; r < 2; ++r) {
    RUBATO_ASSIGN_OR_RETURN(ranks[r], hub->Endpoint(r));
  }
  std::array<DeviceSide, 2> sides;
  for (int r = 0; r < 2; ++r) RUBATO_RETURN_IF_ERROR(sides[r].Init(devices[r], bytes));
  std::vector<std::pair<int, TransferId>> posted;
  // One hop from rank `from` to the other: receive posted, send posted (matched), the
  // receiver's stream waits for it.
  const auto hop = [&](int from, uint64_t tag, bool wait) -> Status {
    const int to = 1 - from;
    const TransferOp recv = TransferOp::Recv(from, tag, sides[to].data, bytes, MemoryKind::kCuda);
    const TransferOp send = TransferOp::Send(to, tag, sides[from].data, bytes, MemoryKind::kCuda);
    RUBATO_ASSIGN_OR_RETURN(const TransferId in,
                            ranks[to]->PostOnStream({&recv, 1}, sides[to].stream));
    RUBATO_ASSIGN_OR_RETURN(const TransferId out,
                            ranks[from]->PostOnStream({&send, 1}, sides[from].stream));
    if (wait) RUBATO_RETURN_IF_ERROR(ranks[to]->StreamWait(in, sides[to].stream));
    posted.insert(posted.end(), {{to, in}, {from, out}});
    return Status::Ok();
  };
  const auto settle = [&]() -> Status {
    for (int r = 0; r < 2; ++r) RUBATO_RETURN_IF_ERROR(sides[r].Sync());
    for (const auto& [rank, id] : posted) RUBATO_RETURN_IF_ERROR(ranks[rank]->Wait(id, kWait));
    posted.clear();
    return Status::Ok();
  };
  RUBATO_RETURN_IF_ERROR(hop(0, 1, true));  // warm-up
  RUBATO_RETURN_IF_ERROR(settle());
  auto begin = Clock::now();
  for (int i = 0; i < rounds; ++i) {
    RUBATO_RETURN_IF_ERROR(hop(0, 1, true));
    RUBATO_RETURN_IF_ERROR(hop(1, 2, true));
  }
  RUBATO_RETURN_IF_ERROR(settle());
  point["cuda_peer_stream_one_way_us"] = Since(begin) * 1e6 / (2.0 * rounds);
  begin = Clock::now();
  for (int i = 0; i < rounds; ++i) RUBATO_RETURN_IF_ERROR(hop(0, 3, false));
  RUBATO_RETURN_IF_ERROR(settle());
  point["cuda_peer_gbps"] = static_cast<double>(bytes) * rounds / Since(begin) / 1e9;
  // Post / Wait on two threads, each waiting on the host for every transfer.
  double post_seconds = 0;
  RUBATO_RETURN_IF_ERROR(OnTwoThreads([&](int r, std::barrier<>& start) -> Status {
    const TransferOp send = TransferOp::Send(1 - r, 4, sides[r].data, bytes, MemoryKind::kCuda);
    const TransferOp recv = TransferOp::Recv(1 - r, 4, sides[r].data, bytes, MemoryKind::kCuda);
    start.arrive_and_wait();
    const auto t0 = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      for (const TransferOp* op : {r == 0 ? &send : &recv, r == 0 ? &recv : &send}) {
        RUBATO_ASSIGN_OR_RETURN(const TransferId id, ranks[r]->Post({op, 1}));
        RUBATO_RETURN_IF_ERROR(ranks[r]->Wait(id, kWait));
      }
    }
    if (r == 0) post_seconds = Since(t0);
    return Status::Ok();
  }));
  point["cuda_peer_post_one_way_us"] = post_seconds * 1e6 / (2.0 * rounds);
  return Status::Ok();
}

// The series and the point keys that hold their figures.
struct Series {
  const char* name;
  const char* latency_key;  // or null
  const char* gbps_key;     // or null
  bool two_gpus;
};
constexpr Series kSeries[] = {
    {"memcpy_peer", "memcpy_peer_one_way_us", "memcpy_peer_gbps", true},
    {"nccl_stream", "nccl_stream_one_way_us", "nccl_gbps", true},
    {"nccl_graph", "nccl_graph_one_way_us", nullptr, true},
    {"nccl_post", "nccl_post_one_way_us", nullptr, true},
    {"nccl_nonblocking", "nccl_nonblocking_stream_one_way_us", nullptr, true},
    {"cuda_peer_stream", "cuda_peer_stream_one_way_us", "cuda_peer_gbps", false},
    {"cuda_peer_post", "cuda_peer_post_one_way_us", nullptr, false},
};

std::string Cell(const Json& point, const char* key) {
  if (key == nullptr || !point.contains(key)) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", point[key].get<double>());
  return text;
}

}  // namespace

Status RunDevicePacks(const std::vector<size_t>& sizes, const DeviceBenchOptions& options,
                      Json& json) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    return UnavailableError("device packs: no CUDA device");
  }
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  const bool two = devices >= 2;
  json["device"] = std::string(prop.name) + " x" + std::to_string(devices);
  json["cuda_peer_devices"] = two ? Json::array({0, 1}) : Json::array({0, 0});
  json["not_run"] = Json::array();
  for (const Series& series : kSeries) {
    if (series.two_gpus && !two) {
      json["not_run"].push_back(
          {{"name", series.name}, {"why", "needs two CUDA devices, found 1"}});
      std::printf("not run: %s (needs two CUDA devices, found 1)\n", series.name);
    }
  }
  std::array<std::unique_ptr<NcclTransport>, 2> nccl, nccl_nonblocking;
  if (two) {
    int access = 0;
    (void)cudaDeviceCanAccessPeer(&access, 0, 1);
    json["peer_access"] = access != 0;
    for (int d = 0; d < 2 && access != 0; ++d) {
      (void)cudaSetDevice(d);
      if (cudaDeviceEnablePeerAccess(1 - d, 0) != cudaSuccess) (void)cudaGetLastError();
    }
    RUBATO_ASSIGN_OR_RETURN(nccl, MakeNccl(true));
    RUBATO_ASSIGN_OR_RETURN(nccl_nonblocking, MakeNccl(false));
  }
  Status status;
  json["points"] = Json::array();
  for (const size_t bytes : sizes) {
    const int rounds = Rounds(bytes, options.max_rounds);
    Json point = {{"bytes", bytes}, {"rounds", rounds}};
    if (two) {
      if (status.ok()) status = MemcpyPeer(bytes, rounds, point);
      if (status.ok()) status = NcclSeries(nccl, bytes, rounds, options, point);
      if (status.ok() && bytes <= (size_t{1} << 20)) {
        status = NcclNonBlockingSeries(nccl_nonblocking, bytes, rounds, point);
      }
    }
    if (status.ok()) status = CudaPeerSeries({0, two ? 1 : 0}, bytes, rounds, point);
    json["points"].push_back(point);
    if (!status.ok()) break;
  }
  // The table: one-way latency per series, then bandwidth.
  std::printf("\none-way latency, us (ping-pong / 2)\n%10s", "bytes");
  for (const Series& series : kSeries) std::printf(" %17s", series.name);
  std::printf("\n");
  for (const Json& point : json["points"]) {
    std::printf("%10zu", point["bytes"].get<size_t>());
    for (const Series& series : kSeries) {
      std::printf(" %17s", Cell(point, series.latency_key).c_str());
    }
    std::printf("\n");
  }
  std::printf("\nbandwidth, GB/s\n%10s %17s %17s %17s %8s\n", "bytes", "memcpy_peer", "nccl",
              "cuda_peer", "nccl/cp");
  double worst_small_us = 0, worst_large_ratio = 0;
  bool any_small = false, any_large = false;
  for (Json& point : json["points"]) {
    const size_t bytes = point["bytes"].get<size_t>();
    std::string ratio = "-";
    if (point.contains("nccl_gbps") && point.contains("memcpy_peer_gbps")) {
      const double r = point["nccl_gbps"].get<double>() / point["memcpy_peer_gbps"].get<double>();
      point["nccl_over_memcpy"] = r;
      ratio = std::to_string(r).substr(0, 5);
      if (bytes >= (size_t{64} << 20)) {
        worst_large_ratio = any_large ? std::min(worst_large_ratio, r) : r;
        any_large = true;
      }
    }
    if (point.contains("nccl_stream_one_way_us") && bytes >= 4096 && bytes <= (size_t{1} << 20)) {
      worst_small_us = std::max(worst_small_us, point["nccl_stream_one_way_us"].get<double>());
      any_small = true;
    }
    std::printf("%10zu %17s %17s %17s %8s\n", bytes, Cell(point, "memcpy_peer_gbps").c_str(),
                Cell(point, "nccl_gbps").c_str(), Cell(point, "cuda_peer_gbps").c_str(),
                ratio.c_str());
  }
  // The targets: NCCL one-way <= 30 us for 4 KB .. 1 MB, >= 0.85x cudaMemcpyPeer at >= 64 MB.
  Json acceptance = {{"latency_target_us", 30.0}, {"bandwidth_target_ratio", 0.85}};
  if (any_small) acceptance["nccl_stream_worst_one_way_us_4k_1m"] = worst_small_us;
  if (any_large) acceptance["nccl_worst_over_memcpy_ge_64m"] = worst_large_ratio;
  json["acceptance"] = acceptance;
  return status;
}

}  // namespace rubato::bench
