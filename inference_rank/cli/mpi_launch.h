// Launch under `mpirun -np N` (DESIGN §1 "Disaggregated mode"): each process takes its role from
// the config's topology.ranks by its MPI rank. A cache rank serves (ServeCacheRank) until an
// inference rank asks it to stop; an inference rank learns the cache rank's RPC endpoint through
// MPI and then connects exactly as `--cache HOST:PORT` does (RPC + UCX). MPI carries only the
// endpoint; the local GPU is the process's node-local rank.
//
//   RUBATO_ASSIGN_OR_RETURN(std::optional<MpiLaunch> launch, JoinMpiLaunch(config));
//   if (launch && launch->is_cache_rank()) return launch->ServeAsCacheRank(config);
//   // else config now names the cache rank: disaggregated, ucx, cache_endpoints = {...}
#pragma once

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

// Not launched by mpirun (or no topology.ranks in the config): nullopt and nothing changes.
// Else joins MPI, checks the ranks table against the world (every rank listed once, at least one
// of each role), and for an inference rank rewrites `config` to reach the first cache rank
// (mode disaggregated, transport ucx, cache_endpoints) and its GPU (engine.device = node-local
// rank). Collective: every rank calls it.
Result<std::optional<MpiLaunch>> JoinMpiLaunch(RubatoConfig& config);

}  // namespace rubato
