// rubato_bench_transport_pingpong: round-trip time and bandwidth of ping-pongs, 4 KiB .. 64 MiB,
// over the loopback transport (two threads of one process) and over UCX between two forked
// processes (UCX_TLS from --tls). A benchmark, not a test: it prints, it does not judge.
//
//   rubato_bench_transport_pingpong [--tls tcp] [--tls posix,self] [--max-mib 64]
//
// One line per (backend, size): median round trip over the iterations (after 2 warm-ups) and
// the bandwidth 2 * bytes / round trip.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transport/loopback_transport.h"
#ifdef RUBATO_HAS_UCX
#include "transport/ucx_transport.h"
#endif

namespace rubato::transport {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kWait(30000);

int Iterations(size_t bytes) {
  return static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / bytes, 5, 1000));
}

std::vector<size_t> Sizes(size_t max_bytes) {
  std::vector<size_t> sizes;
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) sizes.push_back(bytes);
  return sizes;
}

// Rank 0's side: sends `bytes`, receives them back, `iterations` + 2 times; prints the median.
Status Ping(Transport& t, const std::string& label, size_t bytes) {
  std::vector<char> out(bytes, 'p'), back(bytes);
  std::vector<double> round_trips_us;
  const int iterations = Iterations(bytes);
  for (int i = 0; i < iterations + 2; ++i) {
    const auto start = Clock::now();
    RUBATO_ASSIGN_OR_RETURN(TransferId id, t.Post(std::vector<TransferOp>{
                                               TransferOp::Send(1, 1, out.data(), bytes),
                                               TransferOp::Recv(1, 2, back.data(), bytes)}));
    RUBATO_RETURN_IF_ERROR(t.Wait(id, kWait));
    if (i >= 2) {
      round_trips_us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  std::sort(round_trips_us.begin(), round_trips_us.end());
  const double median = round_trips_us[round_trips_us.size() / 2];
  std::printf("%-22s %10zu B  %6d iters  round trip %10.1f us  %7.2f GB/s\n", label.c_str(),
              bytes, iterations, median, 2.0 * double(bytes) / median / 1e3);
  std::fflush(stdout);
  return Status::Ok();
}

// Rank 1's side: echoes what rank 0 sends.
Status Pong(Transport& t, size_t bytes) {
  std::vector<char> buffer(bytes);
  for (int i = 0; i < Iterations(bytes) + 2; ++i) {
    RUBATO_ASSIGN_OR_RETURN(TransferId in, t.Post(std::vector<TransferOp>{
                                               TransferOp::Recv(0, 1, buffer.data(), bytes)}));
    RUBATO_RETURN_IF_ERROR(t.Wait(in, kWait));
    RUBATO_ASSIGN_OR_RETURN(TransferId out, t.Post(std::vector<TransferOp>{
                                                TransferOp::Send(0, 2, buffer.data(), bytes)}));
    RUBATO_RETURN_IF_ERROR(t.Wait(out, kWait));
  }
  return Status::Ok();
}

Status RunLoopback(size_t max_bytes) {
  RUBATO_ASSIGN_OR_RETURN(auto hub, LoopbackHub::Create(2));
  RUBATO_ASSIGN_OR_RETURN(auto rank0, hub->Endpoint(0));
  RUBATO_ASSIGN_OR_RETURN(auto rank1, hub->Endpoint(1));
  const std::vector<size_t> sizes = Sizes(max_bytes);
  Status pong_status;
  std::thread pong([&] {
    for (size_t bytes : sizes) {
      pong_status = Pong(*rank1, bytes);
      if (!pong_status.ok()) return;
    }
  });
  Status ping_status;
  for (size_t bytes : sizes) {
    ping_status = Ping(*rank0, "loopback", bytes);
    if (!ping_status.ok()) break;
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

// One UCX rank in a forked child; exits 0 on success.
[[noreturn]] void UcxRank(int rank, const std::string& tls, int out_fd, int in_fd,
                          size_t max_bytes) {
  setenv("UCX_TLS", tls.c_str(), 1);
  auto report = [rank](const Status& s) { ExitRank(rank, s); };
  auto created = UcxTransport::Create(rank, 2);
  if (!created.ok()) report(created.status());
  std::unique_ptr<UcxTransport> ucx = std::move(created).value();
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
  for (size_t bytes : Sizes(max_bytes)) {
    if (!status.ok()) break;
    status = rank == 0 ? Ping(*ucx, "ucx " + tls, bytes) : Pong(*ucx, bytes);
  }
  ucx.reset();
  ExitRank(rank, status);
}

Status RunUcx(const std::string& tls, size_t max_bytes) {
  int to1[2], to0[2];
  if (pipe(to1) != 0 || pipe(to0) != 0) return IoError("pipe failed");
  std::fflush(nullptr);
  const pid_t rank0 = fork();
  if (rank0 == 0) UcxRank(0, tls, to1[1], to0[0], max_bytes);
  const pid_t rank1 = rank0 > 0 ? fork() : -1;
  if (rank1 == 0) UcxRank(1, tls, to0[1], to1[0], max_bytes);
  for (int fd : {to1[0], to1[1], to0[0], to0[1]}) close(fd);
  int failed = 0;
  for (pid_t pid : {rank0, rank1}) {
    if (pid <= 0) {
      failed++;
      continue;
    }
    int status = 0;
    waitpid(pid, &status, 0);  // each rank's waits are bounded (kWait)
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed > 0) return UnavailableError("ucx " + tls + ": a rank failed (see above)");
  return Status::Ok();
}
#endif

}  // namespace
}  // namespace rubato::transport

int main(int argc, char** argv) {
  std::vector<std::string> tls_list;
  size_t max_bytes = size_t{64} << 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--tls" && i + 1 < argc) {
      tls_list.push_back(argv[++i]);
    } else if (arg == "--max-mib" && i + 1 < argc) {
      max_bytes = size_t(std::strtoull(argv[++i], nullptr, 10)) << 20;
    } else {
      std::fprintf(stderr, "usage: %s [--tls UCX_TLS]... [--max-mib N]\n", argv[0]);
      return 2;
    }
  }
  if (tls_list.empty()) tls_list = {"tcp", "posix,self"};
  rubato::Status status = rubato::transport::RunLoopback(max_bytes);
  if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
#ifdef RUBATO_HAS_UCX
  for (const std::string& tls : tls_list) {
    const rubato::Status ucx = rubato::transport::RunUcx(tls, max_bytes);
    if (!ucx.ok()) std::fprintf(stderr, "%s\n", ucx.ToString().c_str());
    if (status.ok()) status = ucx;
  }
#endif
  return status.ok() ? 0 : 1;
}
