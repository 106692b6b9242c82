// The cache rank's pinned KV storage on a GPU machine: a store whose sessions come from
// MakePinnedKvStorageAllocator holds page-locked memory (CUDA says so), keeps what a KV pack
// appends bit for bit, and a device copy reads and writes it directly.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cache_rank/kv_store.h"
#include "cache_rank/pinned_kv_storage.h"
#include "transport/layer_pack.h"

namespace rubato {
namespace {

TEST(PinnedKvStorage, AllocatesPageLockedMemoryTheStoreAndTheGpuBothUse) {
  auto allocator = MakePinnedKvStorageAllocator();
  EXPECT_EQ(allocator->name(), "pinned");
  auto storage = SessionKvStorage::Allocate(allocator, 1 << 20);
  ASSERT_TRUE(storage.ok()) << storage.status().message();
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, storage->data()), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);  // page-locked host memory, not pageable

  // A store on it: one session, one pack appended, gathered back bit for bit.
  KvStore store(KvStoreOptions{uint64_t{64} << 20, allocator});
  const SessionShape shape{2, 2, 4, 8, DType::kBF16, 64};
  auto session = store.OpenSession(7, shape);
  ASSERT_TRUE(session.ok()) << session.status().message();
  LayerPackShape pack_shape;
  pack_shape.num_layers = 2;
  pack_shape.dtype = DType::kBF16;
  pack_shape.num_kv_heads = 2;
  pack_shape.num_query_heads = 4;
  pack_shape.head_dim = 8;
  const LayerPackRequest request{*session, 0, 3, 3};
  auto bytes = KvPackBytes(pack_shape, {&request, 1});
  ASSERT_TRUE(bytes.ok());
  std::vector<std::byte> buffer(*bytes);
  auto writer = LayerPackWriter::Create(pack_shape, {&request, 1}, buffer);
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  for (uint32_t layer = 0; layer < 2; ++layer) {
    for (auto span : {writer->Key(layer, 0), writer->Value(layer, 0)}) {
      for (size_t i = 0; i < span.size(); ++i) span[i] = std::byte(i * 7 + layer);
    }
  }
  auto view = LayerPackView::Parse(writer->bytes());
  ASSERT_TRUE(view.ok()) << view.status().message();
  ASSERT_TRUE(store.AppendKvPack(*view).ok());
  std::vector<std::byte> keys(3 * 8 * 2), values(3 * 8 * 2);
  const int32_t positions[] = {0, 1, 2};
  ASSERT_TRUE(store.Gather(*session, 1, 1, positions, keys, values).ok());
  // KV head 1's rows of layer 1: [kv_head][token][head_dim] in the pack.
  const std::span<const std::byte> packed = view->Key(1, 0).subspan(3 * 8 * 2);
  EXPECT_EQ(std::memcmp(keys.data(), packed.data(), keys.size()), 0);

  // The GPU reads the pinned rows by DMA.
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 1 << 20), cudaSuccess);
  std::memset(storage->data(), 0x5a, 1 << 20);
  ASSERT_EQ(cudaMemcpy(device, storage->data(), 1 << 20, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<unsigned char> back(1 << 20);
  ASSERT_EQ(cudaMemcpy(back.data(), device, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back.front(), 0x5a);
  EXPECT_EQ(back.back(), 0x5a);
  cudaFree(device);
}

}  // namespace
}  // namespace rubato
