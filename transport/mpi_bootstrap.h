// MPI bootstrap (docs/design.md §1 "Disaggregated mode"): when rubato is launched by
// `mpirun -np N`, MPI tells each process its rank, the world size and its rank on the node (which
// picks the local GPU), and carries the small blobs that connect the data plane: the ncclUniqueId
// that rank 0 makes, the UCX worker addresses of every rank. MPI is used for nothing else; the
// control plane is the RPC and the bulk data goes over the Transport.
//
//   RUBATO_ASSIGN_OR_RETURN(auto mpi, MpiBootstrap::Init(&argc, &argv));
//   RUBATO_ASSIGN_OR_RETURN(std::string id, mpi->Broadcast(mpi->Rank() == 0 ? mine : "", 0));
//
// Only built when MPI is found (RUBATO_HAS_MPI); LaunchedByMpirun() is always available.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace rubato::transport {

// True when the process was started by an MPI launcher (OpenMPI's OMPI_COMM_WORLD_SIZE, PMIx's
// PMIX_RANK or PMI's PMI_RANK is set).
inline bool LaunchedByMpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr || std::getenv("PMI_RANK") != nullptr;
}

class MpiBootstrap {
 public:
  // MPI_Init_thread (the engine and the RPC run threads of their own; MPI is only called from
  // the thread that called Init). Errors come back as Status (MPI_ERRORS_RETURN). At most one
  // MpiBootstrap per process: MPI cannot be initialised twice.
  static Result<std::unique_ptr<MpiBootstrap>> Init(int* argc, char*** argv);
  ~MpiBootstrap();  // MPI_Finalize

  MpiBootstrap(const MpiBootstrap&) = delete;
  MpiBootstrap& operator=(const MpiBootstrap&) = delete;

  int Rank() const { return rank_; }
  int WorldSize() const { return world_size_; }
  int LocalRank() const { return local_rank_; }  // rank among the processes of this node

  // Every rank's `mine`, indexed by rank (blobs may differ in size).
  Result<std::vector<std::string>> AllGather(std::string_view mine);
  // `root`'s value on every rank (the others' `value` is ignored).
  Result<std::string> Broadcast(std::string_view value, int root);
  Status Barrier();
  // MPI_Abort on the world: every rank of the job ends with `exit_code`. Does not return.
  [[noreturn]] void Abort(int exit_code);

 private:
  MpiBootstrap() = default;

  int rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
};

}  // namespace rubato::transport
