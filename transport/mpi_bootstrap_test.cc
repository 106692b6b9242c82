// MPI bootstrap under `mpirun -np N` (ctest runs it so; see transport/CMakeLists.txt): every
// rank checks ranks, blobs of different sizes (one empty) all-gathered in rank order,
// broadcasts from the first and the last rank, and a bad root refused. A plain main, not
// GoogleTest: each rank prints what failed and the exit codes go back through mpirun.
#include <cstdio>
#include <string>
#include <vector>

#include "transport/mpi_bootstrap.h"

namespace {

int failures = 0;

void Check(bool ok, const std::string& what, int rank) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  ++failures;
}

// Rank r's blob: r * 1000 bytes of 'a' + r (rank 1's is empty when the world has 2 ranks: a
// zero-byte blob between two non-empty ones).
std::string BlobOf(int rank, int world) {
  if (rank == 1 && world == 2) return std::string();
  return std::string(static_cast<size_t>(rank) * 1000 + 7, static_cast<char>('a' + rank % 26));
}

}  // namespace

int main(int argc, char** argv) {
  if (!rubato::transport::LaunchedByMpirun()) {
    std::fprintf(stderr, "run me with mpirun -np 2 or more\n");
    return 2;
  }
  auto mpi = rubato::transport::MpiBootstrap::Init(&argc, &argv);
  if (!mpi.ok()) {
    std::fprintf(stderr, "MpiBootstrap::Init: %s\n", mpi.status().message().c_str());
    return 1;
  }
  const int rank = (*mpi)->Rank();
  const int world = (*mpi)->WorldSize();
  Check(world >= 2, "world size " + std::to_string(world) + " >= 2", rank);
  Check(rank >= 0 && rank < world, "rank in range", rank);
  Check((*mpi)->LocalRank() >= 0 && (*mpi)->LocalRank() < world, "local rank in range", rank);
  Check(!(*mpi)->Init(&argc, &argv).ok(), "a second Init is refused", rank);

  auto blobs = (*mpi)->AllGather(BlobOf(rank, world));
  Check(blobs.ok(), "AllGather: " + blobs.status().ToString(), rank);
  if (blobs.ok()) {
    Check(static_cast<int>(blobs->size()) == world, "one blob per rank", rank);
    for (int r = 0; r < world && r < static_cast<int>(blobs->size()); ++r) {
      Check((*blobs)[r] == BlobOf(r, world), "blob of rank " + std::to_string(r), rank);
    }
  }
  for (const int root : {0, world - 1}) {
    const std::string value = "id-from-" + std::to_string(root) + std::string(300, 'x');
    auto received = (*mpi)->Broadcast(rank == root ? value : "ignored", root);
    Check(received.ok() && *received == value,
          "broadcast from " + std::to_string(root) + ": " + received.status().ToString(), rank);
  }
  auto bad = (*mpi)->Broadcast("x", world);
  Check(!bad.ok() && bad.status().message().find("root") != std::string::npos,
        "broadcast from a root outside the world is refused", rank);
  Check((*mpi)->Barrier().ok(), "barrier", rank);
  if (failures == 0) std::printf("rank %d of %d: ok\n", rank, world);
  return failures == 0 ? 0 : 1;
}
