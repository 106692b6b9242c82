// JoinMpiLaunch / MpiLaunch (mpi_launch.h).
#include "inference_rank/cli/mpi_launch.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "inference_rank/cli/cache_command.h"
#include "transport/mpi_bootstrap.h"
#include "transport/rpc/rpc_auth.h"
#include "transport/rpc/rpc_client.h"

namespace rubato {

#ifdef RUBATO_HAS_MPI
class MpiBootstrapHandle {
 public:
  std::unique_ptr<transport::MpiBootstrap> mpi;
};
#else
class MpiBootstrapHandle {};
#endif

MpiLaunch::~MpiLaunch() = default;
MpiLaunch::MpiLaunch(MpiLaunch&&) noexcept = default;
MpiLaunch& MpiLaunch::operator=(MpiLaunch&&) noexcept = default;

namespace {

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

Result<std::optional<MpiLaunch>> JoinMpiLaunch(RubatoConfig& config) {
  if (!transport::LaunchedByMpirun() || config.topology.ranks.empty()) {
    return std::optional<MpiLaunch>();
  }
#ifndef RUBATO_HAS_MPI
  return UnsupportedError(
      "launched by mpirun with topology.ranks, but this rubato was built "
      "without MPI (RUBATO_MPI)");
#else
  MpiLaunch launch;
  launch.mpi_ = std::make_unique<MpiBootstrapHandle>();
  RUBATO_ASSIGN_OR_RETURN(launch.mpi_->mpi, transport::MpiBootstrap::Init(nullptr, nullptr));
  transport::MpiBootstrap& mpi = *launch.mpi_->mpi;
  launch.rank_ = mpi.Rank();
  const int world = mpi.WorldSize();
  // The job's own RPC token unless the environment gives one: rank 0 draws it, every rank takes
  // it before any server or client starts, so that the cache rank authenticates its inference
  // ranks (and serves their Shutdown) and no other local process.
  RUBATO_ASSIGN_OR_RETURN(const std::string given, rpc::AuthTokenFromEnvironment());
  if (given.empty()) {
    std::string drawn;
    if (launch.rank_ == 0) {
      RUBATO_ASSIGN_OR_RETURN(drawn, rpc::RandomAuthToken());
    }
    RUBATO_ASSIGN_OR_RETURN(const std::string token, mpi.Broadcast(drawn, 0));
    setenv(rpc::kTokenEnv, token.c_str(), /*overwrite=*/1);
  }
  std::vector<int> roles(static_cast<size_t>(world), -1);
  for (const RankSpec& spec : config.topology.ranks) {
    if (spec.rank >= world) {
      return InvalidArgumentError("topology.ranks names rank " + std::to_string(spec.rank) +
                                  " but mpirun started " + std::to_string(world) + " processes");
    }
    roles[static_cast<size_t>(spec.rank)] = static_cast<int>(spec.role);
  }
  std::vector<int> cache_ranks;  // every cache rank, in rank order: the endpoints' order
  for (int r = 0; r < world; ++r) {
    if (roles[static_cast<size_t>(r)] < 0) {
      return InvalidArgumentError("topology.ranks gives no role to rank " + std::to_string(r) +
                                  " of the " + std::to_string(world) + " mpirun started");
    }
    if (roles[static_cast<size_t>(r)] == static_cast<int>(RankSpec::Role::kCache)) {
      cache_ranks.push_back(r);
    }
  }
  if (cache_ranks.empty()) {
    return InvalidArgumentError("topology.ranks has no cache rank");
  }
  launch.role_ = static_cast<RankSpec::Role>(roles[static_cast<size_t>(launch.rank_)]);
  RUBATO_ASSIGN_OR_RETURN(const std::vector<std::string> hosts, mpi.AllGather(HostName()));
  for (const std::string& host : hosts) launch.all_on_one_node_ &= host == hosts.front();
  config.engine.device = mpi.LocalRank();
  if (launch.is_cache_rank()) return std::optional<MpiLaunch>(std::move(launch));

  // The cache rank publishes its endpoint once its server runs (ServeAsCacheRank).
  RUBATO_ASSIGN_OR_RETURN(const std::vector<std::string> endpoints, mpi.AllGather(""));
  std::vector<std::string> cache_endpoints;
  for (const int r : cache_ranks) {
    const std::string& endpoint = endpoints[static_cast<size_t>(r)];
    if (endpoint.empty()) {
      return UnavailableError("cache rank " + std::to_string(r) + " did not start its RPC server");
    }
    cache_endpoints.push_back(endpoint);
  }
  config.topology.mode = TopologySection::Mode::kDisaggregated;
  // NCCL when the config asks for it (its communicator forms over the RPC Hello), else UCX.
  if (config.topology.transport != TopologySection::Transport::kNccl) {
    config.topology.transport = TopologySection::Transport::kUcx;
  }
  config.topology.cache_endpoints = std::move(cache_endpoints);
  return std::optional<MpiLaunch>(std::move(launch));
#endif
}

Status RunWithMpiRoles(RubatoConfig& config,
                       const std::function<Status(RubatoConfig&)>& run_inference) {
  RUBATO_ASSIGN_OR_RETURN(std::optional<MpiLaunch> launch, JoinMpiLaunch(config));
  if (!launch.has_value()) return run_inference(config);
  if (launch->is_cache_rank()) return launch->ServeAsCacheRank(config);
  Status status = run_inference(config);
  const Status stopped = launch->StopCacheRank(config);
  if (status.ok()) status = stopped;
  if (!status.ok()) {
    std::fprintf(stderr, "rubato: error: %s\n", status.message().c_str());
    launch->Abort(1);
  }
  return status;
}

Status MpiLaunch::StopCacheRank(const RubatoConfig& config) {
  const auto ask = [&](const std::string& endpoint) -> Status {
    RUBATO_ASSIGN_OR_RETURN(
        std::unique_ptr<rpc::RpcClient> rpc,
        rpc::RpcClient::Connect(endpoint, std::chrono::milliseconds(config.limits.rpc_timeout_ms),
                                rpc::RpcClientOptions::FromLimits(config.limits)));
    rpc::HelloRequest hello;  // control only: no data plane
    hello.set_role(rpc::ROLE_INFERENCE);
    RUBATO_RETURN_IF_ERROR(rpc->Hello(hello).status());
    rpc::ShutdownRequest request;
    request.set_reason("the inference rank of this mpirun finished");
    return rpc->Shutdown(request).status();
  };
  Status first_error;
  for (const std::string& endpoint : config.topology.cache_endpoints) {
    const Status stopped = ask(endpoint);
    // Unreachable or hanging up: the cache rank is going or gone (it may close the connection
    // before its answer is written, or mpirun passed a SIGINT / SIGTERM to every rank), which
    // is what was asked for.
    if (stopped.code() != StatusCode::kUnavailable && !stopped.ok() && first_error.ok()) {
      first_error = stopped;
    }
  }
  return first_error;
}

void MpiLaunch::Abort(int exit_code) {
#ifdef RUBATO_HAS_MPI
  mpi_->mpi->Abort(exit_code);
#endif
  std::_Exit(exit_code);
}

Status MpiLaunch::ServeAsCacheRank(const RubatoConfig& config) {
#ifndef RUBATO_HAS_MPI
  return UnsupportedError("this rubato was built without MPI");
#else
  transport::MpiBootstrap& mpi = *mpi_->mpi;
  // One node: loopback; several: this host's name, which the inference ranks resolve.
  const std::string host = all_on_one_node_ ? "127.0.0.1" : HostName();
  const std::string listen = (all_on_one_node_ ? "127.0.0.1" : "0.0.0.0") + std::string(":0");
  bool published = false;
  CacheArgs args;
  args.listen = listen;
  // The storage is the config's cache section; its GPU, unless cache.device names one, is the
  // node-local rank (JoinMpiLaunch).
  if (config.cache.device < 0) args.device = config.engine.device;
  const Status served =
      ServeCacheRank(args, config, [&](const std::string& bound) -> Status {
        const std::string port = bound.substr(bound.rfind(':') + 1);
        published = true;
        std::printf("rubato cache (mpi rank %d): listening on %s:%s\n", rank_, host.c_str(),
                    port.c_str());
        std::fflush(stdout);
        return mpi.AllGather(host + ":" + port).status();
      });
  if (!published) {
    // The inference ranks wait in the endpoint all-gather: give them an empty endpoint, which
    // they report, instead of leaving them blocked.
    (void)mpi.AllGather("");
  }
  return served;
#endif
}

}  // namespace rubato
