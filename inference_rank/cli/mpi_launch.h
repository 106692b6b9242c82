// Launch under `mpirun -np N` (docs/design.md §1 "Disaggregated mode"): each process takes its role
// from the config's topology.ranks by its MPI rank. A cache rank serves (ServeCacheRank) until an
// inference rank asks it to stop; an inference rank learns every cache rank's RPC endpoint
// through MPI and then connects exactly as `--cache A,B,...` does (RPC + UCX, or NCCL with
// topology.transport nccl). MPI carries only the endpoint (an NCCL communicator's unique id goes
// in the RPC Hello, as without mpirun); the local GPU is the process's node-local rank, for the
// cache rank too.
//
//   return RunWithMpiRoles(config, [&](RubatoConfig& config) { return Generate(config); });
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/config.h"
#include "common/status.h"

namespace rubato {

class MpiBootstrapHandle;  // the MPI session (transport/mpi_bootstrap.h), finalized at the end

class MpiLaunch {
 public:
  ~MpiLaunch();
  MpiLaunch(MpiLaunch&&) noexcept;
  MpiLaunch& operator=(MpiLaunch&&) noexcept;

  bool is_cache_rank() const { return role_ == RankSpec::Role::kCache; }
  int rank() const { return rank_; }
  // Serves this cache rank until an inference rank's Shutdown (or SIGTERM).
  Status ServeAsCacheRank(const RubatoConfig& config);
  // Asks every cache rank (config.topology.cache_endpoints) to stop: an inference rank's
  // last act, since the job ends only when every rank does.
  Status StopCacheRank(const RubatoConfig& config);
  // Ends every rank of the job (MPI_Abort): what an inference rank does on an error, since the
  // cache rank would otherwise serve on and MPI_Finalize wait for it. Does not return.
  [[noreturn]] void Abort(int exit_code);

 private:
  friend Result<std::optional<MpiLaunch>> JoinMpiLaunch(RubatoConfig& config);
  MpiLaunch() = default;

  std::unique_ptr<MpiBootstrapHandle> mpi_;
  RankSpec::Role role_ = RankSpec::Role::kInference;
  int rank_ = 0;
  bool all_on_one_node_ = true;
};

// What `rubato generate` and `rubato serve` do with their config: runs `run_inference(config)`
// directly when not launched by mpirun with topology.ranks; under mpirun a cache rank serves
// instead, and an inference rank runs it against the cache rank, then stops the cache rank so
// the job ends, and aborts the job (after printing the error) when anything failed.
Status RunWithMpiRoles(RubatoConfig& config,
                       const std::function<Status(RubatoConfig&)>& run_inference);

// Not launched by mpirun (or no topology.ranks in the config): nullopt and nothing changes.
// Else joins MPI, checks the ranks table against the world (every rank listed once, at least one
// of each role), and for an inference rank rewrites `config` to reach every cache rank, in rank
// order (mode disaggregated, transport nccl when the config says so else ucx, cache_endpoints);
// every rank's GPU is engine.device = its node-local rank. Collective: every rank calls it.
Result<std::optional<MpiLaunch>> JoinMpiLaunch(RubatoConfig& config);

}  // namespace rubato
