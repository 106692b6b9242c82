// cuda_peer (transport/cuda_peer_transport.h): device packs byte for byte between two ranks on
// one GPU (runs on any GPU machine) and on two GPUs (skipped below two), at several sizes both
// ways, posted behind producer streams and handed to consumer streams by StreamWait; a ready
// event ordering a Post without a stream; device ids out of range refused. The matching logic
// is tested on the CPU (transport/peer_transport_test.cc).
#include "transport/cuda_peer_transport.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace rubato::transport {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kTimeout{20000};

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + seed * 7 + i / 251);
  return data;
}

int DeviceCount() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess ? devices : 0;
}

// One rank's buffers and streams on its device.
struct RankSide {
  int device = 0;
  cudaStream_t producer = nullptr, consumer = nullptr;
  void* send = nullptr;
  void* recv = nullptr;
  void* out = nullptr;

  RankSide(int on, size_t bytes) : device(on) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), cudaSuccess);
    for (void** buffer : {&send, &recv, &out}) {
      EXPECT_EQ(cudaMalloc(buffer, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemset(*buffer, 0, bytes), cudaSuccess);
    }
  }
  ~RankSide() {
    (void)cudaSetDevice(device);
    for (void* buffer : {send, recv, out}) (void)cudaFree(buffer);
    (void)cudaStreamDestroy(producer);
    (void)cudaStreamDestroy(consumer);
  }
  RankSide(const RankSide&) = delete;
  RankSide& operator=(const RankSide&) = delete;
};

// Each rank sends its pattern to the other from a buffer its producer stream just filled;
// the received bytes reach `out` by the consumer stream after StreamWait; compared byte for
// byte. Both endpoints are driven from this thread.
void ExchangeBothWays(std::array<int, 2> devices, size_t bytes, uint64_t tag) {
  auto hub = CreateCudaPeerHub(devices);
  ASSERT_TRUE(hub.ok()) << hub.status().message();
  std::unique_ptr<StreamOrderedTransport> ranks[2];
  for (int r = 0; r < 2; ++r) {
    auto endpoint = (*hub)->Endpoint(r);
    ASSERT_TRUE(endpoint.ok()) << endpoint.status().message();
    ranks[r] = std::move(endpoint).value();
  }
  EXPECT_EQ(ranks[0]->BackendName(), "cuda_peer");
  std::unique_ptr<RankSide> sides[2];
  for (int r = 0; r < 2; ++r) sides[r] = std::make_unique<RankSide>(devices[r], bytes);
  TransferId ids[2] = {};
  std::vector<uint8_t> patterns[2];
  for (int r = 0; r < 2; ++r) {  // rank 0 posts first: its receive waits, its send waits
    RankSide& me = *sides[r];
    patterns[r] = Pattern(bytes, static_cast<uint32_t>(tag * 4 + r));
    ASSERT_EQ(cudaSetDevice(me.device), cudaSuccess);
    ASSERT_EQ(
        cudaMemcpyAsync(me.send, patterns[r].data(), bytes, cudaMemcpyHostToDevice, me.producer),
        cudaSuccess);
    const TransferOp ops[] = {TransferOp::Send(1 - r, tag, me.send, bytes, MemoryKind::kCuda),
                              TransferOp::Recv(1 - r, tag, me.recv, bytes, MemoryKind::kCuda)};
    auto id = ranks[r]->PostOnStream(ops, me.producer);
    ASSERT_TRUE(id.ok()) << id.status().message();
    ids[r] = *id;
  }
  for (int r = 0; r < 2; ++r) {
    RankSide& me = *sides[r];
    const Status waited = ranks[r]->StreamWait(ids[r], me.consumer);
    ASSERT_TRUE(waited.ok()) << waited.message();
    ASSERT_EQ(cudaMemcpyAsync(me.out, me.recv, bytes, cudaMemcpyDeviceToDevice, me.consumer),
              cudaSuccess);
  }
  for (int r = 0; r < 2; ++r) {
    RankSide& me = *sides[r];
    ASSERT_EQ(cudaSetDevice(me.device), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(me.consumer), cudaSuccess);
    std::vector<uint8_t> got(bytes);
    ASSERT_EQ(cudaMemcpy(got.data(), me.out, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(got == patterns[1 - r])
        << bytes << " bytes into rank " << r << " (device " << me.device << ")";
    ASSERT_TRUE(ranks[r]->Wait(ids[r], kTimeout).ok());
  }
  EXPECT_EQ(ranks[0]->Stats().bytes_sent, bytes);
  EXPECT_EQ(ranks[1]->Stats().bytes_received, bytes);
}

const size_t kSizes[] = {1, 4096, 65536 + 3, size_t{1} << 20, (size_t{33} << 20) + 5};

TEST(CudaPeerTransport, TwoRanksOnOneGpuAreByteExactBothWays) {
  if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  uint64_t tag = 1;
  for (const size_t bytes : kSizes) ExchangeBothWays({0, 0}, bytes, tag++);
}

TEST(CudaPeerTransport, TwoRanksOnTwoGpusAreByteExactBothWays) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two GPUs (nvidia-h200-x2), found " << DeviceCount();
  uint64_t tag = 1;
  for (const size_t bytes : kSizes) ExchangeBothWays({0, 1}, bytes, tag++);
}

TEST(CudaPeerTransport, AReadyEventOrdersAPostWithoutAStream) {
  if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  const int second = DeviceCount() >= 2 ? 1 : 0;
  const int devices[] = {0, second};
  auto hub = CreateCudaPeerHub(devices);
  ASSERT_TRUE(hub.ok()) << hub.status().message();
  auto sender = (*hub)->Endpoint(0);
  auto receiver = (*hub)->Endpoint(1);
  ASSERT_TRUE(sender.ok() && receiver.ok());
  constexpr size_t kBytes = 16 << 20;
  RankSide a(0, kBytes), b(second, kBytes);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaEvent_t filled = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(a.send, 0x5a, kBytes, a.producer), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(filled, a.producer), cudaSuccess);
  const TransferOp recv = TransferOp::Recv(0, 3, b.recv, kBytes, MemoryKind::kCuda);
  auto in = (*receiver)->Post({&recv, 1});
  ASSERT_TRUE(in.ok()) << in.status().message();
  const TransferOp send = TransferOp::Send(1, 3, a.send, kBytes, MemoryKind::kCuda, filled);
  auto out = (*sender)->Post({&send, 1});
  ASSERT_TRUE(out.ok()) << out.status().message();
  ASSERT_TRUE((*receiver)->Wait(*in, kTimeout).ok());
  ASSERT_TRUE((*sender)->Wait(*out, kTimeout).ok());
  std::vector<uint8_t> got(kBytes);
  ASSERT_EQ(cudaMemcpy(got.data(), b.recv, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(got == std::vector<uint8_t>(kBytes, 0x5a)) << "the copy ran before its producer";
  cudaEventDestroy(filled);
}

TEST(CudaPeerTransport, RefusesDevicesThisProcessDoesNotSee) {
  if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  const int devices[] = {0, DeviceCount()};
  auto hub = CreateCudaPeerHub(devices);
  ASSERT_FALSE(hub.ok());
  EXPECT_NE(hub.status().message().find("rank 1 on device"), std::string::npos)
      << hub.status().message();
  EXPECT_FALSE(CreateCudaPeerHub(std::span<const int>()).ok());
}

}  // namespace
}  // namespace rubato::transport
