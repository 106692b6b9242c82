// MPI bootstrap (mpi_bootstrap.h): init / finalize, node-local rank, blob all-gather and
// broadcast with every MPI error returned as a Status.
#include "transport/mpi_bootstrap.h"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <string>

namespace rubato::transport {
namespace {

Status MpiStatus(int code, std::string_view what) {
  if (code == MPI_SUCCESS) return Status::Ok();
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return UnavailableError("mpi: " + std::string(what) + ": " + std::string(text, length));
}

}  // namespace

Result<std::unique_ptr<MpiBootstrap>> MpiBootstrap::Init(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized != 0) {
    return FailedPreconditionError("mpi: MPI is already initialised in this process");
  }
  int provided = 0;
  RUBATO_RETURN_IF_ERROR(
      MpiStatus(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread"));
  std::unique_ptr<MpiBootstrap> mpi(new MpiBootstrap());  // finalizes on every return below
  RUBATO_RETURN_IF_ERROR(MpiStatus(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
                                   "setting MPI_ERRORS_RETURN"));
  RUBATO_RETURN_IF_ERROR(MpiStatus(MPI_Comm_rank(MPI_COMM_WORLD, &mpi->rank_), "MPI_Comm_rank"));
  RUBATO_RETURN_IF_ERROR(
      MpiStatus(MPI_Comm_size(MPI_COMM_WORLD, &mpi->world_size_), "MPI_Comm_size"));
  MPI_Comm node = MPI_COMM_NULL;
  RUBATO_RETURN_IF_ERROR(MpiStatus(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, mpi->rank_, MPI_INFO_NULL, &node),
      "splitting the ranks by node"));
  const Status local = MpiStatus(MPI_Comm_rank(node, &mpi->local_rank_), "node-local rank");
  MPI_Comm_free(&node);
  RUBATO_RETURN_IF_ERROR(local);
  return mpi;
}

MpiBootstrap::~MpiBootstrap() { MPI_Finalize(); }

Result<std::vector<std::string>> MpiBootstrap::AllGather(std::string_view mine) {
  if (mine.size() > static_cast<size_t>(INT_MAX)) {
    return InvalidArgumentError("mpi: all-gather blob of " + std::to_string(mine.size()) +
                                " bytes is larger than MPI's int count");
  }
  const int my_size = static_cast<int>(mine.size());
  std::vector<int> sizes(world_size_);
  RUBATO_RETURN_IF_ERROR(MpiStatus(
      MPI_Allgather(&my_size, 1, MPI_INT, sizes.data(), 1, MPI_INT, MPI_COMM_WORLD),
      "all-gathering blob sizes"));
  std::vector<int> offsets(world_size_);
  long long total = 0;
  for (int r = 0; r < world_size_; ++r) {
    if (total > INT_MAX) break;
    offsets[r] = static_cast<int>(total);
    total += sizes[r];
  }
  if (total > INT_MAX) {
    return InvalidArgumentError("mpi: all-gathered blobs total " + std::to_string(total) +
                                " bytes, more than MPI's int count");
  }
  std::string gathered(static_cast<size_t>(total), '\0');
  RUBATO_RETURN_IF_ERROR(MpiStatus(
      MPI_Allgatherv(mine.data(), my_size, MPI_BYTE, gathered.data(), sizes.data(),
                     offsets.data(), MPI_BYTE, MPI_COMM_WORLD),
      "all-gathering blobs"));
  std::vector<std::string> blobs(world_size_);
  for (int r = 0; r < world_size_; ++r) blobs[r] = gathered.substr(offsets[r], sizes[r]);
  return blobs;
}

Result<std::string> MpiBootstrap::Broadcast(std::string_view value, int root) {
  if (root < 0 || root >= world_size_) {
    return InvalidArgumentError("mpi: broadcast root " + std::to_string(root) + " outside [0, " +
                                std::to_string(world_size_) + ")");
  }
  if (rank_ == root && value.size() > static_cast<size_t>(INT_MAX)) {
    return InvalidArgumentError("mpi: broadcast blob of " + std::to_string(value.size()) +
                                " bytes is larger than MPI's int count");
  }
  int size = rank_ == root ? static_cast<int>(value.size()) : 0;
  RUBATO_RETURN_IF_ERROR(
      MpiStatus(MPI_Bcast(&size, 1, MPI_INT, root, MPI_COMM_WORLD), "broadcasting a size"));
  std::string result = rank_ == root ? std::string(value) : std::string(size, '\0');
  RUBATO_RETURN_IF_ERROR(MpiStatus(
      MPI_Bcast(result.data(), size, MPI_BYTE, root, MPI_COMM_WORLD), "broadcasting a blob"));
  return result;
}

void MpiBootstrap::Abort(int exit_code) {
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

Status MpiBootstrap::Barrier() { return MpiStatus(MPI_Barrier(MPI_COMM_WORLD), "barrier"); }

}  // namespace rubato::transport
