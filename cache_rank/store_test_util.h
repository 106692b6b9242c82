// Test helpers for the cache-rank tests: build KV packs whose rows come from a fill function,
// and snapshot a store's contents to prove an operation changed nothing.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "cache_rank/kv_store.h"
#include "transport/layer_pack.h"

namespace rubato::cache_rank_test {

// Writes one row (head_dim elements, session dtype) of K (kv == 0) or V (kv == 1) for
// (request index, absolute layer, kv head, absolute position).
using RowFill = std::function<void(uint32_t request, uint32_t layer, int kv, uint32_t kv_head,
                                   uint32_t position, std::span<std::byte> row)>;

// A deterministic byte per (session, layer, kv, head, position, byte index): distinct enough
// that a row copied from the wrong place shows.
inline std::byte RowPatternByte(uint64_t session, uint32_t layer, int kv, uint32_t head,
                                uint32_t position, size_t index) {
  return static_cast<std::byte>((session * 97u + layer * 61u + kv * 37u + head * 23u +
                                 position * 13u + index * 5u + 3u) & 0xffu);
}

// Owns a KV pack's bytes and its parsed view.
struct BuiltPack {
  std::vector<std::byte> bytes;
  LayerPackView view;
};

// Builds a KV pack of layers [first_layer, first_layer + num_layers) for `requests` with the
// session shape's heads / head_dim / dtype, rows from `fill` (default: RowPatternByte of the
// request's session id).
inline BuiltPack BuildKvPack(const SessionShape& shape, uint64_t step, uint32_t first_layer,
                             uint32_t num_layers, const std::vector<LayerPackRequest>& requests,
                             RowFill fill = nullptr) {
  LayerPackShape pack;
  pack.kind = LayerPackKind::kKvPack;
  pack.step = step;
  pack.first_layer = first_layer;
  pack.num_layers = num_layers;
  pack.dtype = shape.dtype;
  pack.num_kv_heads = shape.num_kv_heads;
  pack.num_query_heads = shape.num_query_heads;
  pack.head_dim = shape.head_dim;
  BuiltPack built;
  auto size = KvPackBytes(pack, requests);
  EXPECT_TRUE(size.ok()) << size.status().ToString();
  built.bytes.resize(size.ok() ? *size : 0);
  auto writer = LayerPackWriter::Create(pack, requests, built.bytes);
  EXPECT_TRUE(writer.ok()) << writer.status().ToString();
  if (!writer.ok()) return built;
  const size_t row_bytes = size_t{shape.head_dim} * DTypeSize(shape.dtype);
  for (uint32_t l = 0; l < num_layers; ++l) {
    for (uint32_t r = 0; r < requests.size(); ++r) {
      const LayerPackRequest& request = requests[r];
      for (int kv = 0; kv < 2; ++kv) {
        std::span<std::byte> section = kv == 0 ? writer->Key(l, r) : writer->Value(l, r);
        for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
          for (uint32_t t = 0; t < request.new_tokens; ++t) {
            auto row = section.subspan((size_t{h} * request.new_tokens + t) * row_bytes,
                                       row_bytes);
            const uint32_t position = request.first_position + t;
            if (fill) {
              fill(r, first_layer + l, kv, h, position, row);
            } else {
              for (size_t i = 0; i < row.size(); ++i) {
                row[i] = RowPatternByte(request.session_id, first_layer + l, kv, h, position, i);
              }
            }
          }
        }
      }
    }
  }
  auto view = LayerPackView::Parse(built.bytes);
  EXPECT_TRUE(view.ok()) << view.status().ToString();
  if (view.ok()) built.view = *view;
  return built;
}

// Every readable row, length and shape of the given sessions, plus the store's stats: equal
// snapshots mean an operation wrote nothing.
struct StoreSnapshot {
  std::vector<std::vector<std::byte>> rows;
  std::vector<uint32_t> lengths;
  KvStoreStats stats;

  bool operator==(const StoreSnapshot& other) const {
    return rows == other.rows && lengths == other.lengths &&
           stats.appends == other.stats.appends &&
           stats.bytes_appended == other.stats.bytes_appended &&
           stats.gathers == other.stats.gathers;
  }
};

inline StoreSnapshot Snapshot(const KvStore& store, const std::vector<uint64_t>& sessions) {
  StoreSnapshot snapshot;
  for (uint64_t id : sessions) {
    const SessionShape shape = *store.GetSessionShape(id);
    snapshot.lengths.push_back(*store.SessionLength(id));
    for (uint32_t layer = 0; layer < shape.num_layers; ++layer) {
      snapshot.lengths.push_back(*store.LayerLength(id, layer));
      for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
        const KvHeadRows rows = *store.HeadRows(id, layer, h);
        // Whole capacity: a write past the readable rows would show too.
        snapshot.rows.emplace_back(rows.keys.begin(), rows.keys.end());
        snapshot.rows.emplace_back(rows.values.begin(), rows.values.end());
      }
    }
  }
  snapshot.stats = store.Stats();
  return snapshot;
}

}  // namespace rubato::cache_rank_test
