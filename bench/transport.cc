// rubato_bench_transport: what moving bytes between two ranks costs, per transport backend
// (loopback, UCX per UCX_TLS, NCCL between two GPUs beside cudaMemcpyPeer, and layer-pack round
// trips at Qwen3-8B shapes, in transport_nccl.cc; device packs over the stream-ordered paths of
// NCCL and cuda_peer, in transport_device.cc): bandwidth and latency against message size. A
// benchmark, not a test: a table per backend, JSON with --out.
// Method and command lines: docs/benchmarks.md "Transport".
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "transport/loopback_transport.h"
#ifdef RUBATO_HAS_UCX
#include <sys/wait.h>
#include <unistd.h>

#include "transport/ucx_transport.h"
#endif
#ifdef RUBATO_HAS_NCCL
#include "bench/transport_device.h"
#include "bench/transport_nccl.h"
#endif

#ifndef RUBATO_GIT_COMMIT
#define RUBATO_GIT_COMMIT "unknown"
#endif

namespace rubato {
namespace {

using transport::TransferId;
using transport::TransferOp;
using transport::Transport;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

struct Options {
  std::vector<std::string> backends;  // empty: every backend built in
  std::vector<std::string> sizes;     // empty: each backend's default
  std::vector<std::string> tls = {"tcp", "posix,self"};
  // nccl only (compiled in NCCL builds; the flags parse everywhere):
  int iterations = 20;
  int pipeline = 8;
  std::vector<int> pack_layers = {4, 6, 12};
  int pack_batch = 8;
  int pack_selected = 2048;  // compact rows per KV head the reply carries (AsyncSpade: top-2k)
  // device only:
  int device_rounds = 200;
  int graph_rounds = 20;
  std::string out;
  std::string commit = RUBATO_GIT_COMMIT;
};

// 4 KiB, 16 KiB, ... up to `largest`.
std::vector<std::string> PowersOfFour(const std::string& largest) {
  const std::vector<std::string> all = {"4K", "16K", "64K", "256K", "1M",
                                        "4M", "16M", "64M", "256M", "1G"};
  const auto end = std::find(all.begin(), all.end(), largest);
  return {all.begin(), end == all.end() ? end : end + 1};
}

Result<std::vector<size_t>> ParseSizes(const std::vector<std::string>& texts) {
  std::vector<size_t> sizes;
  for (const std::string& text : texts) {
    const char unit = text.empty() ? '0' : text.back();
    const int shift = unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
    const std::string digits = shift == 0 ? text : text.substr(0, text.size() - 1);
    if (digits.empty() || digits.size() > 12 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      return InvalidArgumentError("--sizes: '" + text + "' is not a size like 4096, 64K, 16M, 1G");
    }
    sizes.push_back(static_cast<size_t>(std::stoull(digits)) << shift);
  }
  return sizes;
}

// ---- ping-pong over loopback and UCX ----------------------------------------------------------

constexpr std::chrono::milliseconds kPingWait(30000);

// One (backend, size) line of the ping-pong table. Trivially copyable: a forked UCX rank sends
// it to the parent through a pipe.
struct PingResult {
  size_t bytes = 0;
  int iterations = 0;
  double round_trip_us = 0;  // median
  double gbps = 0;           // 2 x bytes / round trip
};

int PingIterations(size_t bytes) {
  return static_cast<int>(
      std::clamp<size_t>((size_t{512} << 20) / std::max<size_t>(bytes, 1), 5, 1000));
}

// Rank 0's side: sends `bytes`, receives them back, iterations + 2 times; prints the median.
Result<PingResult> Ping(Transport& t, const std::string& label, size_t bytes) {
  std::vector<char> out(bytes, 'p'), back(bytes);
  std::vector<double> round_trips_us;
  const int iterations = PingIterations(bytes);
  for (int i = 0; i < iterations + 2; ++i) {
    const auto start = Clock::now();
    RUBATO_ASSIGN_OR_RETURN(
        TransferId id, t.Post(std::vector<TransferOp>{TransferOp::Send(1, 1, out.data(), bytes),
                                                      TransferOp::Recv(1, 2, back.data(), bytes)}));
    RUBATO_RETURN_IF_ERROR(t.Wait(id, kPingWait));
    if (i >= 2) {
      round_trips_us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  std::sort(round_trips_us.begin(), round_trips_us.end());
  PingResult result{.bytes = bytes,
                    .iterations = iterations,
                    .round_trip_us = round_trips_us[round_trips_us.size() / 2]};
  result.gbps = 2.0 * static_cast<double>(bytes) / result.round_trip_us / 1e3;
  std::printf("%-22s %10zu B  %6d iters  round trip %10.1f us  %7.2f GB/s\n", label.c_str(), bytes,
              iterations, result.round_trip_us, result.gbps);
  std::fflush(stdout);
  return result;
}

// Rank 1's side: echoes what rank 0 sends.
Status Pong(Transport& t, size_t bytes) {
  std::vector<char> buffer(bytes);
  for (int i = 0; i < PingIterations(bytes) + 2; ++i) {
    RUBATO_ASSIGN_OR_RETURN(
        TransferId in,
        t.Post(std::vector<TransferOp>{TransferOp::Recv(0, 1, buffer.data(), bytes)}));
    RUBATO_RETURN_IF_ERROR(t.Wait(in, kPingWait));
    RUBATO_ASSIGN_OR_RETURN(
        TransferId out,
        t.Post(std::vector<TransferOp>{TransferOp::Send(0, 2, buffer.data(), bytes)}));
    RUBATO_RETURN_IF_ERROR(t.Wait(out, kPingWait));
  }
  return Status::Ok();
}

Status RunLoopback(const std::vector<size_t>& sizes, std::vector<PingResult>& results) {
  RUBATO_ASSIGN_OR_RETURN(auto hub, transport::LoopbackHub::Create(2));
  RUBATO_ASSIGN_OR_RETURN(auto rank0, hub->Endpoint(0));
  RUBATO_ASSIGN_OR_RETURN(auto rank1, hub->Endpoint(1));
  Status pong_status;
  std::thread pong([&] {
    for (size_t bytes : sizes) {
      pong_status = Pong(*rank1, bytes);
      if (!pong_status.ok()) return;
    }
  });
  Status ping_status;
  for (size_t bytes : sizes) {
    auto result = Ping(*rank0, "loopback", bytes);
    if (!result.ok()) {
      ping_status = result.status();
      break;
    }
    results.push_back(*result);
  }
  if (!ping_status.ok()) rank0.reset();  // fails rank 1's pending ops, so the thread ends
  pong.join();
  return ping_status.ok() ? pong_status : ping_status;
}

#ifdef RUBATO_HAS_UCX
// Ends a forked rank: 0 when `status` is ok.
[[noreturn]] void ExitRank(int rank, const Status& status) {
  if (!status.ok()) std::fprintf(stderr, "rank %d: %s\n", rank, status.ToString().c_str());
  std::fflush(nullptr);
  _exit(status.ok() ? 0 : 1);
}

// One UCX rank in a forked child: exchanges worker addresses with the other rank through the
// pipes `out_fd` / `in_fd`, runs its side of every size, and (rank 0) writes a PingResult per
// size to `results_fd`. Exits 0 on success.
[[noreturn]] void UcxRank(int rank, const std::string& tls, const std::vector<size_t>& sizes,
                          int out_fd, int in_fd, int results_fd) {
  setenv("UCX_TLS", tls.c_str(), 1);
  auto report = [rank](const Status& s) { ExitRank(rank, s); };
  auto created = transport::UcxTransport::Create(rank, 2);
  if (!created.ok()) report(created.status());
  std::unique_ptr<transport::UcxTransport> ucx = std::move(created).value();
  const auto mine = ucx->LocalAddress();
  const uint64_t size = mine.size();
  std::vector<std::byte> peer;
  uint64_t peer_size = 0;
  if (write(out_fd, &size, sizeof(size)) != sizeof(size) ||
      write(out_fd, mine.data(), mine.size()) != ssize_t(mine.size()) ||
      read(in_fd, &peer_size, sizeof(peer_size)) != sizeof(peer_size) || peer_size > (1 << 20)) {
    report(IoError("exchanging addresses failed"));
  }
  peer.resize(peer_size);
  for (size_t got = 0; got < peer.size();) {
    const ssize_t n = read(in_fd, peer.data() + got, peer.size() - got);
    if (n <= 0) report(IoError("reading the peer's address failed"));
    got += size_t(n);
  }
  Status status = ucx->Connect(1 - rank, peer);
  for (size_t bytes : sizes) {
    if (!status.ok()) break;
    if (rank == 1) {
      status = Pong(*ucx, bytes);
      continue;
    }
    auto result = Ping(*ucx, "ucx " + tls, bytes);
    if (!result.ok()) {
      status = result.status();
    } else if (write(results_fd, &*result, sizeof(PingResult)) != sizeof(PingResult)) {
      status = IoError("writing a result to the parent failed");
    }
  }
  ucx.reset();
  ExitRank(rank, status);
}

// Two forked ranks (so that UCX_TLS=posix carries bytes between processes, as between an
// inference rank and a cache rank on one host).
Status RunUcx(const std::string& tls, const std::vector<size_t>& sizes,
              std::vector<PingResult>& results) {
  int to1[2], to0[2], from0[2];
  if (pipe(to1) != 0 || pipe(to0) != 0 || pipe(from0) != 0) return IoError("pipe failed");
  std::fflush(nullptr);
  // Each rank closes the ends it does not use, so that a rank that dies gives the other an EOF.
  const pid_t rank0 = fork();
  if (rank0 == 0) {
    for (int fd : {to1[0], to0[1], from0[0]}) close(fd);
    UcxRank(0, tls, sizes, to1[1], to0[0], from0[1]);
  }
  const pid_t rank1 = rank0 > 0 ? fork() : -1;
  if (rank1 == 0) {
    for (int fd : {to1[1], to0[0], from0[0], from0[1]}) close(fd);
    UcxRank(1, tls, sizes, to0[1], to1[0], -1);
  }
  for (int fd : {to1[0], to1[1], to0[0], to0[1], from0[1]}) close(fd);
  PingResult result;
  while (read(from0[0], &result, sizeof(result)) == sizeof(result)) results.push_back(result);
  close(from0[0]);
  int failed = 0;
  for (pid_t pid : {rank0, rank1}) {
    if (pid <= 0) {
      failed++;
      continue;
    }
    int status = 0;
    waitpid(pid, &status, 0);  // each rank's waits are bounded (kPingWait)
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed > 0) return UnavailableError("ucx " + tls + ": a rank failed (see above)");
  return Status::Ok();
}
#endif  // RUBATO_HAS_UCX

// Appends one JSON row per result to `rows`.
void AppendPingRows(const std::string& backend, const std::string& tls,
                    const std::vector<PingResult>& results, Json& rows) {
  for (const PingResult& r : results) {
    Json row = {{"backend", backend},
                {"bytes", r.bytes},
                {"iterations", r.iterations},
                {"round_trip_us", r.round_trip_us},
                {"gbps", r.gbps}};
    if (!tls.empty()) row["tls"] = tls;
    rows.push_back(row);
  }
}

// The backends this binary was built with.
std::vector<std::string> BuiltBackends() {
  std::vector<std::string> built = {"loopback"};
#ifdef RUBATO_HAS_UCX
  built.push_back("ucx");
#endif
#ifdef RUBATO_HAS_NCCL
  built.push_back("nccl");
  built.push_back("device");
#endif
  return built;
}

// Runs one backend; its results go under json["pingpong"] or json["nccl"].
Status RunBackend(const std::string& backend, const Options& options, Json& json) {
  const bool host = backend != "nccl" && backend != "device";
  RUBATO_ASSIGN_OR_RETURN(
      const std::vector<size_t> sizes,
      ParseSizes(!options.sizes.empty() ? options.sizes : PowersOfFour(host ? "64M" : "1G")));
  if (backend == "loopback") {
    std::vector<PingResult> results;
    const Status status = RunLoopback(sizes, results);
    AppendPingRows(backend, "", results, json["pingpong"]);
    return status;
  }
#ifdef RUBATO_HAS_UCX
  if (backend == "ucx") {
    Status status;
    for (const std::string& tls : options.tls) {
      std::vector<PingResult> results;
      const Status ucx = RunUcx(tls, sizes, results);
      AppendPingRows(backend, tls, results, json["pingpong"]);
      if (status.ok()) status = ucx;
    }
    return status;
  }
#endif
#ifdef RUBATO_HAS_NCCL
  if (backend == "nccl") {
    Json nccl;
    const bench::NcclBenchOptions nccl_options{options.iterations, options.pipeline,
                                               options.pack_layers, options.pack_batch,
                                               options.pack_selected};
    const Status status = bench::RunNccl(sizes, nccl_options, nccl);
    if (!nccl.is_null()) json["nccl"] = nccl;  // what was measured before a failure too
    return status;
  }
  if (backend == "device") {
    Json device;
    const Status status = bench::RunDevicePacks(
        sizes, {.max_rounds = options.device_rounds, .graph_rounds = options.graph_rounds}, device);
    if (!device.is_null()) json["device_packs"] = device;
    return status;
  }
#endif
  std::string built;
  for (const std::string& name : BuiltBackends()) built += (built.empty() ? "" : ", ") + name;
  return UnsupportedError(backend + ": not in this build (built: " + built + ")");
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  using namespace rubato;
  Options options;
  CLI::App app("Transport round trips (loopback, UCX) and GPU-to-GPU bandwidth (NCCL)");
  app.add_option("--backend", options.backends,
                 "loopback, ucx, nccl, device (default: every one built in; nccl only with 2 "
                 "GPUs, device with 1 or more)")
      ->delimiter(',')
      ->check(CLI::IsMember({"loopback", "ucx", "nccl", "device"}));
  app.add_option("--sizes", options.sizes,
                 "message sizes, e.g. 4096,64K,16M,1G (default 4K .. 64M; nccl 4K .. 1G)")
      ->delimiter(',');
  app.add_option("--tls", options.tls, "ucx: UCX_TLS of one run, repeatable (tcp, posix,self)");
  app.add_option("--iterations", options.iterations, "nccl: timed transfers per size")
      ->check(CLI::Range(1, 100000));
  app.add_option("--pipeline", options.pipeline, "nccl: transfers in flight for bandwidth")
      ->check(CLI::Range(1, 1024));
  app.add_option("--pack-layers", options.pack_layers, "nccl: layers per pack (P)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  app.add_option("--pack-batch", options.pack_batch, "nccl: requests per pack")
      ->check(CLI::Range(1, 1024));
  app.add_option("--pack-selected", options.pack_selected, "nccl: compact rows per KV head")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--device-rounds", options.device_rounds,
                 "device: most ping-pong rounds / copies per size (about 1 GiB moved)")
      ->check(CLI::Range(4, 100000));
  app.add_option("--graph-rounds", options.graph_rounds,
                 "device: ping-pong rounds captured in one CUDA graph")
      ->check(CLI::Range(1, 10000));
  app.add_option("--out", options.out, "write the results as JSON here");
  app.add_option("--commit", options.commit, "commit recorded in the JSON (default: the build's)");
  CLI11_PARSE(app, argc, argv);
  if (const auto sizes = ParseSizes(options.sizes); !sizes.ok()) {
    std::fprintf(stderr, "rubato_bench_transport: error: %s\n", sizes.status().message().c_str());
    return 2;
  }

  // Host backends first: the UCX ranks are forked before this process initializes CUDA.
  const std::vector<std::string> order = {"loopback", "ucx", "nccl", "device"};
  const std::vector<std::string> built = BuiltBackends();
  const bool chosen = !options.backends.empty();
  std::vector<std::string> backends;
  for (const std::string& backend : order) {
    const auto& from = chosen ? options.backends : built;
    if (std::find(from.begin(), from.end(), backend) != from.end()) backends.push_back(backend);
  }
  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  Json json = {{"benchmark", "transport"}, {"commit", options.commit}, {"command", command}};
  json["backends"] = Json::array();
  json["pingpong"] = Json::array();
  json["not_run"] = Json::array();
  bool failed = false;
  for (const std::string& backend : backends) {
#ifdef RUBATO_HAS_NCCL
    if (backend == "nccl" && !chosen && bench::CudaDeviceCount() < 2) {
      std::printf("\n== nccl: skipped, fewer than two CUDA devices (--backend nccl insists)\n");
      json["not_run"].push_back({{"name", "nccl"}, {"why", "fewer than two CUDA devices"}});
      continue;
    }
    if (backend == "device" && !chosen && bench::CudaDeviceCount() < 1) {
      std::printf("\n== device: skipped, no CUDA device (--backend device insists)\n");
      json["not_run"].push_back({{"name", "device"}, {"why", "no CUDA device"}});
      continue;
    }
#endif
    json["backends"].push_back(backend);
    std::printf("\n== %s\n", backend.c_str());
    std::fflush(stdout);
    const Status status = RunBackend(backend, options, json);
    if (!status.ok()) {
      std::fprintf(stderr, "rubato_bench_transport: error: %s\n", status.ToString().c_str());
      json["errors"].push_back(status.ToString());
      failed = true;
    }
  }
  if (!options.out.empty()) {
    std::ofstream out(options.out);
    out << json.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "rubato_bench_transport: error: cannot write %s\n", options.out.c_str());
      return 1;
    }
  }
  return failed ? 1 : 0;
}
