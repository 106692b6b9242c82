// Delta replies in the layer-pack format: a delta reply written from a CompactSlotMap's deltas
// parses, validates and rebuilds the full reply's rows in a CompactPool; its size follows
// delta_rows, not reply_slots; malformed delta sections are refused naming the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "transport/compact_delta.h"
#include "transport/layer_pack.h"

namespace rubato {
namespace {

constexpr uint32_t kHeads = 2;
constexpr uint32_t kHeadDim = 4;

LayerPackShape DeltaReplyShape() {
  LayerPackShape shape;
  shape.kind = LayerPackKind::kReplyPack;
  shape.step = 9;
  shape.num_kv_heads = kHeads;
  shape.num_query_heads = kHeads;
  shape.head_dim = kHeadDim;
  shape.delta = true;
  return shape;
}

float RowValue(uint32_t head, int32_t position, uint32_t d) {
  return static_cast<float>(head * 100 + position) + 0.125f * d;
}

// Writes a delta reply (one layer, one request) carrying `deltas` (one per head).
std::vector<uint64_t> WriteDeltaReply(const std::vector<CompactDelta>& deltas, uint32_t reply_slots,
                                      uint32_t first_position, uint64_t& size) {
  LayerPackRequest request{7, first_position, 1, reply_slots, 0, 0, 0};
  for (const CompactDelta& delta : deltas) {
    request.delta_rows =
        std::max<uint32_t>(request.delta_rows, static_cast<uint32_t>(delta.slots.size()));
    request.delta_reset = delta.reset ? 1 : 0;
  }
  size = *ReplyPackBytes(DeltaReplyShape(), {&request, 1});
  std::vector<uint64_t> words((size + 7) / 8);
  const std::span<std::byte> out(reinterpret_cast<std::byte*>(words.data()), size);
  Result<LayerPackWriter> writer = LayerPackWriter::Create(DeltaReplyShape(), {&request, 1}, out);
  EXPECT_TRUE(writer.ok()) << writer.status().message();
  const uint32_t rows = request.delta_rows;
  for (uint32_t h = 0; h < kHeads; ++h) {
    const CompactDelta& delta = deltas[h];
    StoreInt32(writer->Counts(0, 0), h, delta.count);
    for (uint32_t i = 0; i < rows; ++i) {
      const bool entering = i < delta.slots.size();
      StoreInt32(writer->Slots(0, 0), h * rows + i, entering ? delta.slots[i] : -1);
      StoreInt32(writer->Positions(0, 0), h * rows + i, entering ? delta.positions[i] : -1);
      for (uint32_t d = 0; d < kHeadDim; ++d) {
        const float value = entering ? RowValue(h, delta.positions[i], d) : 0.0f;
        std::memcpy(writer->Key(0, 0).data() + ((h * rows + i) * kHeadDim + d) * 4, &value, 4);
        std::memcpy(writer->Value(0, 0).data() + ((h * rows + i) * kHeadDim + d) * 4, &value, 4);
      }
    }
  }
  return words;
}

Status ApplyReply(const LayerPackView& view, CompactPool& pool) {
  RUBATO_RETURN_IF_ERROR(ValidateReplyContents(view));
  const LayerPackRequest& request = view.requests()[0];
  const uint32_t rows = request.delta_rows;
  for (uint32_t h = 0; h < kHeads; ++h) {
    std::vector<int32_t> slots, positions;
    for (uint32_t i = 0; i < rows; ++i) {
      const int32_t p = LoadInt32(view.Positions(0, 0), h * rows + i);
      if (p == -1) break;
      positions.push_back(p);
      slots.push_back(LoadInt32(view.Slots(0, 0), h * rows + i));
    }
    const auto* keys = reinterpret_cast<const float*>(view.Key(0, 0).data()) + h * rows * kHeadDim;
    const auto* values =
        reinterpret_cast<const float*>(view.Value(0, 0).data()) + h * rows * kHeadDim;
    RUBATO_RETURN_IF_ERROR(pool.Apply(h, request.delta_reset != 0, LoadInt32(view.Counts(0, 0), h),
                                      slots, positions, {keys, positions.size() * kHeadDim},
                                      {values, positions.size() * kHeadDim}));
  }
  return Status::Ok();
}

TEST(LayerPackDeltaTest, ADeltaReplyRebuildsTheFullRowsAndIsSmaller) {
  constexpr uint32_t kSlots = 6;
  std::vector<CompactSlotMap> maps(kHeads, CompactSlotMap(kSlots));
  CompactPool pool(kHeads, kSlots, kHeadDim);
  const std::vector<std::vector<int32_t>> steps[] = {{{0, 1, 2, 3, 4, 5}, {0, 2, 4, 6, 8, 10}},
                                                     {{0, 1, 2, 3, 4, 9}, {0, 2, 4, 6, 8, 11}},
                                                     {{0, 1, 7, 8, 9, 12}, {0, 2, 4, 6, 8, 11}}};
  uint64_t full_size = 0;
  for (uint32_t step = 0; step < 3; ++step) {
    std::vector<CompactDelta> deltas;
    for (uint32_t h = 0; h < kHeads; ++h) deltas.push_back(*maps[h].Update(steps[step][h]));
    uint64_t size = 0;
    const auto words = WriteDeltaReply(deltas, kSlots, 13, size);
    const Result<LayerPackView> view = LayerPackView::Parse(
        {reinterpret_cast<const std::byte*>(words.data()), static_cast<size_t>(size)});
    ASSERT_TRUE(view.ok()) << view.status().message();
    EXPECT_TRUE(view->delta());
    const Status applied = ApplyReply(*view, pool);
    ASSERT_TRUE(applied.ok()) << applied.message();
    if (step == 0) {
      full_size = size;
      EXPECT_EQ(view->requests()[0].delta_reset, 1u);
    } else {
      EXPECT_LT(size, full_size) << "step " << step;
    }
    for (uint32_t h = 0; h < kHeads; ++h) {
      std::vector<int32_t> held(pool.positions(h).begin(), pool.positions(h).end());
      std::sort(held.begin(), held.end());
      EXPECT_EQ(held, steps[step][h]) << "step " << step << " head " << h;
      for (size_t slot = 0; slot < held.size(); ++slot) {
        const int32_t p = pool.positions(h)[slot];
        EXPECT_EQ(pool.keys()[(h * kSlots + slot) * kHeadDim + 1], RowValue(h, p, 1));
      }
    }
  }
}

TEST(LayerPackDeltaTest, MalformedDeltaSectionsAreRefusedByName) {
  CompactSlotMap map0(4), map1(4);
  std::vector<CompactDelta> deltas{*map0.Update(std::vector<int32_t>{1, 2}),
                                   *map1.Update(std::vector<int32_t>{3, 5})};
  uint64_t size = 0;
  auto words = WriteDeltaReply(deltas, 4, 9, size);
  auto* bytes = reinterpret_cast<std::byte*>(words.data());
  const auto parse_and_check = [&]() {
    const Result<LayerPackView> view = LayerPackView::Parse({bytes, static_cast<size_t>(size)});
    return view.ok() ? ValidateReplyContents(*view) : view.status();
  };
  ASSERT_TRUE(parse_and_check().ok());
  const Result<LayerPackView> view = LayerPackView::Parse({bytes, static_cast<size_t>(size)});
  const std::span<std::byte> slots{const_cast<std::byte*>(view->Slots(0, 0).data()),
                                   view->Slots(0, 0).size()};
  StoreInt32(slots, 1, 0);  // head 0's second row into slot 0 again
  EXPECT_NE(parse_and_check().message().find("delta slot[1] = 0"), std::string::npos)
      << parse_and_check().message();
  StoreInt32(slots, 1, 1);
  // delta_rows past reply_slots.
  const size_t entry = sizeof(LayerPackHeader);
  const uint32_t too_many = 5;
  std::memcpy(bytes + entry + offsetof(LayerPackRequestEntry, delta_rows), &too_many, 4);
  EXPECT_NE(parse_and_check().message().find("'delta_rows' is 5"), std::string::npos)
      << parse_and_check().message();
}

}  // namespace
}  // namespace rubato
