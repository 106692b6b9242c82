// NcclTransport's stream-ordered path between two GPUs of one host, one rank a thread (needs 2
// GPUs: the nvidia-h200-x2 machine). Device packs byte for byte at several sizes both ways
// through Enqueue on the ranks' own streams (one op: no group; two: a group), PostOnStream with
// StreamWait handing the bytes to a consumer stream without a host wait, and the exchange
// captured in a CUDA graph and replayed with new bytes each time.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/nccl_transport.h"

namespace rubato::transport {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kTimeout{20000};

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + seed * 7 + i / 251);
  return data;
}

// A device buffer of the current device, freed at scope end.
struct DeviceBytes {
  explicit DeviceBytes(size_t bytes) : size(bytes) {
    EXPECT_EQ(cudaMalloc(&data, bytes == 0 ? 1 : bytes), cudaSuccess);
  }
  ~DeviceBytes() { (void)cudaFree(data); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> host(size);
    EXPECT_EQ(cudaMemcpy(host.data(), data, size, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  void* data = nullptr;
  size_t size = 0;
};

class NcclStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    if (devices < 2) GTEST_SKIP() << "needs two GPUs (nvidia-h200-x2), found " << devices;
    auto id = NcclTransport::NewUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().message();
    Status statuses[2];
    OnBothRanks([&](int r) {
      auto created =
          NcclTransport::Create({.unique_id = *id, .rank = r, .world_size = 2, .device = r});
      if (created.ok()) {
        ranks_[r] = std::move(created).value();
      } else {
        statuses[r] = created.status();
      }
    });
    for (const Status& status : statuses) ASSERT_TRUE(status.ok()) << status.message();
  }

  // Runs body(rank) on two threads, each with its device selected.
  static void OnBothRanks(const std::function<void(int)>& body) {
    std::thread threads[2];
    for (int r = 0; r < 2; ++r) {
      threads[r] = std::thread([&, r] {
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        body(r);
      });
    }
    for (std::thread& thread : threads) thread.join();
  }

  std::unique_ptr<NcclTransport> ranks_[2];
};

TEST_F(NcclStreamTest, EnqueueMovesDevicePacksByteExactBothWays) {
  const size_t sizes[] = {1, 4096, 65536 + 3, size_t{1} << 20, (size_t{33} << 20) + 5};
  for (const size_t bytes : sizes) {
    OnBothRanks([&](int r) {
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      const std::vector<uint8_t> mine = Pattern(bytes, static_cast<uint32_t>(r + 1));
      DeviceBytes send(bytes), both(bytes), one_way(bytes);
      // The producer is the stream's own copy: Enqueue orders the send after it.
      ASSERT_EQ(cudaMemcpyAsync(send.data, mine.data(), bytes, cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      const TransferOp pair[] = {TransferOp::Send(1 - r, 5, send.data, bytes, MemoryKind::kCuda),
                                 TransferOp::Recv(1 - r, 5, both.data, bytes, MemoryKind::kCuda)};
      const Status grouped = ranks_[r]->Enqueue(pair, stream);
      ASSERT_TRUE(grouped.ok()) << grouped.message();
      // Then one op per Enqueue (no group): rank 0 sends, rank 1 receives.
      const TransferOp single =
          r == 0 ? TransferOp::Send(1, 6, send.data, bytes, MemoryKind::kCuda)
                 : TransferOp::Recv(0, 6, one_way.data, bytes, MemoryKind::kCuda);
      const Status alone = ranks_[r]->Enqueue({&single, 1}, stream);
      ASSERT_TRUE(alone.ok()) << alone.message();
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(both.Read(), Pattern(bytes, static_cast<uint32_t>(2 - r)))
          << bytes << " bytes, rank " << r;
      if (r == 1) {
        EXPECT_EQ(one_way.Read(), Pattern(bytes, 1)) << bytes << " bytes one way";
      }
      cudaStreamDestroy(stream);
    });
  }
  EXPECT_EQ(ranks_[0]->Stats().bytes_sent, ranks_[1]->Stats().bytes_received);
  EXPECT_GT(ranks_[0]->Stats().bytes_sent, size_t{66} << 20);
}

TEST_F(NcclStreamTest, PostOnStreamAndStreamWaitHandBytesToAConsumerStream) {
  constexpr size_t kBytes = 3 << 20;
  constexpr int kRounds = 20;  // more rounds than the event pool needs: events are reused
  OnBothRanks([&](int r) {
    cudaStream_t producer = nullptr, consumer = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), cudaSuccess);
    DeviceBytes buffer(kBytes), copy(kBytes);
    for (int round = 0; round < kRounds; ++round) {
      const uint8_t value = static_cast<uint8_t>(round * 3 + 1);
      if (r == 0) {
        ASSERT_EQ(cudaMemsetAsync(buffer.data, value, kBytes, producer), cudaSuccess);
        const TransferOp send = TransferOp::Send(1, 9, buffer.data, kBytes, MemoryKind::kCuda);
        auto id = ranks_[0]->PostOnStream({&send, 1}, producer);
        ASSERT_TRUE(id.ok()) << id.status().message();
        ASSERT_TRUE(ranks_[0]->Wait(*id, kTimeout).ok());
      } else {
        const TransferOp recv = TransferOp::Recv(0, 9, buffer.data, kBytes, MemoryKind::kCuda);
        auto id = ranks_[1]->PostOnStream({&recv, 1}, producer);
        ASSERT_TRUE(id.ok()) << id.status().message();
        // The consumer copies the received bytes once the transfer is done, ordered on the GPU.
        ASSERT_TRUE(ranks_[1]->StreamWait(*id, consumer).ok());
        ASSERT_EQ(
            cudaMemcpyAsync(copy.data, buffer.data, kBytes, cudaMemcpyDeviceToDevice, consumer),
            cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(consumer), cudaSuccess);
        const std::vector<uint8_t> got = copy.Read();
        ASSERT_EQ(got, std::vector<uint8_t>(kBytes, value)) << "round " << round;
        ASSERT_TRUE(ranks_[1]->Wait(*id, kTimeout).ok());
        EXPECT_EQ(ranks_[1]->StreamWait(*id, consumer).code(), StatusCode::kInvalidArgument)
            << "a released id is unknown";
      }
    }
    cudaStreamDestroy(producer);
    cudaStreamDestroy(consumer);
  });
  EXPECT_EQ(ranks_[1]->Stats().bytes_received, kBytes * kRounds);
}

TEST_F(NcclStreamTest, ACapturedGraphReplaysTheExchangeWithNewBytes) {
  constexpr size_t kBytes = (256 << 10) + 12;
  constexpr int kReplays = 4;
  std::barrier step(2);
  OnBothRanks([&](int r) {
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    DeviceBytes source(kBytes), send(kBytes), recv(kBytes), out(kBytes);
    const TransferOp ops[] = {TransferOp::Send(1 - r, 2, send.data, kBytes, MemoryKind::kCuda),
                              TransferOp::Recv(1 - r, 2, recv.data, kBytes, MemoryKind::kCuda)};
    // One exchange outside the graph first: NCCL sets up what these sizes need.
    ASSERT_TRUE(ranks_[r]->Enqueue(ops, stream).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    // The graph: the producer (source -> send), the exchange, the consumer (recv -> out).
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(send.data, source.data, kBytes, cudaMemcpyDeviceToDevice, stream),
              cudaSuccess);
    const Status captured = ranks_[r]->Enqueue(ops, stream);
    ASSERT_EQ(cudaMemcpyAsync(out.data, recv.data, kBytes, cudaMemcpyDeviceToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(captured.ok()) << captured.message();
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    const uint64_t sent_after_capture = ranks_[r]->Stats().bytes_sent;
    for (int replay = 0; replay < kReplays; ++replay) {
      const std::vector<uint8_t> mine = Pattern(kBytes, static_cast<uint32_t>(10 * replay + r));
      // On the graph's stream: a plain cudaMemcpy from pageable memory may return before its
      // bytes land, and the non-blocking stream would not wait for them.
      ASSERT_EQ(cudaMemcpyAsync(source.data, mine.data(), kBytes, cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(out.Read(), Pattern(kBytes, static_cast<uint32_t>(10 * replay + 1 - r)))
          << "replay " << replay << ", rank " << r;
      step.arrive_and_wait();  // the peer read its bytes before this rank's next source
    }
    EXPECT_EQ(ranks_[r]->Stats().bytes_sent, sent_after_capture) << "replays count nothing";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  });
}

TEST_F(NcclStreamTest, EnqueueRefusesBadOpsAndANullStream) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBytes device(16);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const TransferOp to_self = TransferOp::Send(0, 1, device.data, 16, MemoryKind::kCuda);
  EXPECT_EQ(ranks_[0]->Enqueue({&to_self, 1}, stream).code(), StatusCode::kInvalidArgument);
  uint8_t host[16] = {};
  const TransferOp host_send = TransferOp::Send(1, 1, host, sizeof(host));
  EXPECT_EQ(ranks_[0]->Enqueue({&host_send, 1}, stream).code(), StatusCode::kInvalidArgument);
  const TransferOp good = TransferOp::Send(1, 1, device.data, 16, MemoryKind::kCuda);
  const Status null_stream = ranks_[0]->Enqueue({&good, 1}, nullptr);
  EXPECT_EQ(null_stream.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(null_stream.message().find("needs a stream"), std::string::npos)
      << null_stream.message();
  EXPECT_EQ(ranks_[0]->PostOnStream({&good, 1}, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace rubato::transport
