// One request's split-by-head KV (see split_by_head_kv.h).
#include "inference_rank/residency/split_by_head/split_by_head_kv.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace rubato {
namespace {

void CopyRow(const float* from, float* to, int head_dim) {
  std::memcpy(to, from, static_cast<size_t>(head_dim) * sizeof(float));
}

// The row of `position` in an ascending list, or -1.
int RowOf(const std::vector<int>& positions, int position) {
  const auto it = std::lower_bound(positions.begin(), positions.end(), position);
  return it != positions.end() && *it == position ? static_cast<int>(it - positions.begin()) : -1;
}

}  // namespace

SplitByHeadKv::SplitByHeadKv(const HeadSplit& split, int head_dim, int capacity, KvFetcher& fetcher,
                             SplitByHeadCounters& counters)
    : split_(split),
      head_dim_(head_dim),
      capacity_(capacity),
      kv_heads_(split.num_kv_heads),
      fetcher_(fetcher),
      counters_(counters),
      layers_(static_cast<size_t>(split.num_layers)) {
  nr_index_.assign(static_cast<size_t>(split.num_layers) * kv_heads_, -1);
  for (int l = 0; l < split.num_layers; ++l) {
    int nr = 0;
    for (int h = 0; h < kv_heads_; ++h) {
      if (!split.IsRepresentative(l, h)) nr_index_[static_cast<size_t>(l) * kv_heads_ + h] = nr++;
    }
    Layer& layer = layers_[static_cast<size_t>(l)];
    const size_t store = static_cast<size_t>(nr) * capacity * head_dim;
    layer.store_keys.assign(store, 0.0f);
    layer.store_values.assign(store, 0.0f);
    layer.front_keys.assign(static_cast<size_t>(kv_heads_) * head_dim, 0.0f);
    layer.front_values.assign(static_cast<size_t>(kv_heads_) * head_dim, 0.0f);
    layer.counts.assign(static_cast<size_t>(kv_heads_), 0);
    layer.front_positions.resize(static_cast<size_t>(kv_heads_));
    layer.static_keys.resize(static_cast<size_t>(kv_heads_));
    layer.static_values.resize(static_cast<size_t>(kv_heads_));
    layer.static_sets.resize(static_cast<size_t>(split.clusters(l)));
  }
}

SplitByHeadKv::~SplitByHeadKv() {
  for (Layer& layer : layers_) {
    if (layer.incoming.active) layer.incoming.done.wait();
  }
}

void SplitByHeadKv::SelectInitial(int layer, std::vector<std::vector<int>> static_sets,
                                  std::vector<std::vector<int>> dynamic_sets) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  for (auto& set : static_sets) std::sort(set.begin(), set.end());
  for (auto& set : dynamic_sets) std::sort(set.begin(), set.end());
  l.pending_static = std::move(static_sets);
  l.pending_dynamic = std::move(dynamic_sets);
  l.initial_pending = true;
}

void SplitByHeadKv::Anticipate(int layer, std::vector<std::vector<int>> dynamic_sets) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  for (auto& set : dynamic_sets) std::sort(set.begin(), set.end());
  l.pending_dynamic = std::move(dynamic_sets);
  l.anticipation_pending = true;
}

const std::vector<int>& SplitByHeadKv::StaticSet(int layer, int cluster) const {
  return layers_[static_cast<size_t>(layer)].static_sets[static_cast<size_t>(cluster)];
}

size_t SplitByHeadKv::StoreOffset(int layer, int kv_head, int position) const {
  const int nr = nr_index_[static_cast<size_t>(layer) * kv_heads_ + kv_head];
  return (static_cast<size_t>(nr) * capacity_ + position) * head_dim_;
}

void SplitByHeadKv::RebuildFront(Layer& l, int layer, const std::vector<std::vector<int>>& sets,
                                 const std::vector<std::vector<float>>& keys,
                                 const std::vector<std::vector<float>>& values) {
  int capacity = 1;
  for (int h = 0; h < kv_heads_; ++h) {
    if (split_.IsRepresentative(layer, h)) continue;
    const int g = split_.cluster[layer][h];
    capacity = std::max<int>(capacity, static_cast<int>(l.static_sets[g].size() + sets[g].size()));
  }
  l.front_capacity = capacity;
  const size_t floats = static_cast<size_t>(kv_heads_) * capacity * head_dim_;
  l.front_keys.assign(floats, 0.0f);
  l.front_values.assign(floats, 0.0f);
  for (int h = 0; h < kv_heads_; ++h) {
    std::vector<int>& positions = l.front_positions[static_cast<size_t>(h)];
    positions.clear();
    l.counts[static_cast<size_t>(h)] = 0;
    if (split_.IsRepresentative(layer, h)) continue;
    const int g = split_.cluster[layer][h];
    const std::vector<int>& fixed = l.static_sets[static_cast<size_t>(g)];
    const std::vector<int>& moving = sets[static_cast<size_t>(g)];
    size_t a = 0, b = 0;
    while (a < fixed.size() || b < moving.size()) {  // merge by position; a repeat counts once
      const bool take_fixed = b == moving.size() || (a < fixed.size() && fixed[a] <= moving[b]);
      const int position = take_fixed ? fixed[a] : moving[b];
      const size_t row = take_fixed ? a : b;
      const std::vector<float>& k = take_fixed ? l.static_keys[h] : keys[h];
      const std::vector<float>& v = take_fixed ? l.static_values[h] : values[h];
      if (take_fixed && b < moving.size() && moving[b] == position) ++b;
      take_fixed ? ++a : ++b;
      const int r = static_cast<int>(positions.size());
      const size_t to = (static_cast<size_t>(h) * capacity + r) * head_dim_;
      CopyRow(k.data() + row * head_dim_, l.front_keys.data() + to, head_dim_);
      CopyRow(v.data() + row * head_dim_, l.front_values.data() + to, head_dim_);
      positions.push_back(position);
    }
    l.counts[static_cast<size_t>(h)] = static_cast<int>(positions.size());
  }
}

Status SplitByHeadKv::BeginStep(int layer, int position) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  if (!l.incoming.active || position <= l.incoming.selected_at) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  l.incoming.done.get();  // rethrows nothing: the job only copies rows
  counters_.exposed_wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  RebuildFront(l, layer, l.incoming.sets, l.incoming.keys, l.incoming.values);
  l.recent_begin = l.incoming.selected_at + 1;
  l.incoming = Incoming();
  return Status::Ok();
}

Status SplitByHeadKv::Offload(int layer, const float* k, const float* v, int start_position,
                              int tokens) {
  if (start_position < 0 || start_position + tokens > capacity_) {
    return InternalError("split_by_head: positions [" + std::to_string(start_position) + ", " +
                         std::to_string(start_position + tokens) +
                         ") outside the request's store of " + std::to_string(capacity_));
  }
  Layer& l = layers_[static_cast<size_t>(layer)];
  int64_t rows = 0;
  for (int h = 0; h < kv_heads_; ++h) {
    if (split_.IsRepresentative(layer, h)) continue;
    for (int t = 0; t < tokens; ++t) {
      const size_t from = (static_cast<size_t>(t) * kv_heads_ + h) * head_dim_;
      const size_t to = StoreOffset(layer, h, start_position + t);
      CopyRow(k + from, l.store_keys.data() + to, head_dim_);
      CopyRow(v + from, l.store_values.data() + to, head_dim_);
      ++rows;
    }
  }
  counters_.rows_offloaded += rows;
  return Status::Ok();
}

Status SplitByHeadKv::ApplySelection(int layer, const PagedKvView& kv, int position) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  const int clusters = split_.clusters(layer);
  if (l.initial_pending) {
    l.initial_pending = false;
    if (static_cast<int>(l.pending_static.size()) != clusters ||
        static_cast<int>(l.pending_dynamic.size()) != clusters) {
      return InternalError("split_by_head: a prompt selection of layer " + std::to_string(layer) +
                           " must hold " + std::to_string(clusters) + " clusters");
    }
    l.static_sets = std::move(l.pending_static);
    // The rows of `set` of NR-head h out of the store (the prompt's rows: no fetch).
    auto copy = [&](int h, const std::vector<int>& set, std::vector<float>& k,
                    std::vector<float>& v) -> Status {
      k.clear(), v.clear();
      for (int p : set) {
        if (p < 0 || p > position) {
          return InternalError("split_by_head: selected position " + std::to_string(p) +
                               " outside [0, " + std::to_string(position) + "]");
        }
        const size_t at = StoreOffset(layer, h, p);
        k.insert(k.end(), l.store_keys.begin() + at, l.store_keys.begin() + at + head_dim_);
        v.insert(v.end(), l.store_values.begin() + at, l.store_values.begin() + at + head_dim_);
      }
      return Status::Ok();
    };
    std::vector<std::vector<float>> keys(kv_heads_), values(kv_heads_);
    for (int h = 0; h < kv_heads_; ++h) {
      if (split_.IsRepresentative(layer, h)) continue;
      const int g = split_.cluster[layer][h];
      RUBATO_RETURN_IF_ERROR(copy(h, l.static_sets[g], l.static_keys[h], l.static_values[h]));
      RUBATO_RETURN_IF_ERROR(copy(h, l.pending_dynamic[g], keys[h], values[h]));
    }
    RebuildFront(l, layer, l.pending_dynamic, keys, values);
    l.pending_dynamic.clear();
    l.recent_begin = position + 1;
    l.installed = true;
  }
  if (!l.anticipation_pending) return Status::Ok();
  l.anticipation_pending = false;
  if (l.incoming.active) {
    return InternalError("split_by_head: an anticipation of layer " + std::to_string(layer) +
                         " while the previous fetch was not swapped in");
  }
  if (static_cast<int>(l.pending_dynamic.size()) != clusters) {
    return InternalError("split_by_head: an anticipation of layer " + std::to_string(layer) +
                         " must hold " + std::to_string(clusters) + " clusters");
  }
  Incoming& in = l.incoming;
  in.sets = std::move(l.pending_dynamic);
  in.selected_at = position;
  in.keys.assign(static_cast<size_t>(kv_heads_), {});
  in.values.assign(static_cast<size_t>(kv_heads_), {});
  struct Remote {
    int kv_head, row, position;
  };
  std::vector<Remote> remote;
  int64_t reused = 0;
  for (int h = 0; h < kv_heads_; ++h) {
    if (split_.IsRepresentative(layer, h)) continue;
    const std::vector<int>& set = in.sets[static_cast<size_t>(split_.cluster[layer][h])];
    in.keys[h].assign(set.size() * head_dim_, 0.0f);
    in.values[h].assign(set.size() * head_dim_, 0.0f);
    for (size_t i = 0; i < set.size(); ++i) {
      const int p = set[i];
      if (p < 0 || p > position) {
        return InternalError("split_by_head: selected position " + std::to_string(p) +
                             " outside [0, " + std::to_string(position) + "]");
      }
      float* k = in.keys[h].data() + i * head_dim_;
      float* v = in.values[h].data() + i * head_dim_;
      const int front_row = RowOf(l.front_positions[static_cast<size_t>(h)], p);
      if (front_row >= 0) {  // already local: the front
        const size_t at = (static_cast<size_t>(h) * l.front_capacity + front_row) * head_dim_;
        CopyRow(l.front_keys.data() + at, k, head_dim_);
        CopyRow(l.front_values.data() + at, v, head_dim_);
        ++reused;
      } else if (p >= l.recent_begin) {  // already local: the recent positions
        CopyRow(kv.keys + kv.Offset(p, h), k, head_dim_);
        CopyRow(kv.values + kv.Offset(p, h), v, head_dim_);
        ++reused;
      } else {
        remote.push_back({h, static_cast<int>(i), p});
      }
    }
  }
  counters_.rows_reused += reused;
  counters_.rows_fetched += static_cast<int64_t>(remote.size());
  counters_.bytes_fetched +=
      static_cast<int64_t>(remote.size()) * 2 * head_dim_ * static_cast<int64_t>(sizeof(float));
  ++counters_.fetches;
  // The job writes only `in`'s buffers, read by nobody before BeginStep waits for it, and reads
  // store rows at positions <= `position`, which Offload never writes again.
  in.done = fetcher_.Submit([this, layer, &in, remote = std::move(remote)] {
    const Layer& from = layers_[static_cast<size_t>(layer)];
    for (const Remote& r : remote) {
      const size_t at = StoreOffset(layer, r.kv_head, r.position);
      CopyRow(from.store_keys.data() + at,
              in.keys[r.kv_head].data() + static_cast<size_t>(r.row) * head_dim_, head_dim_);
      CopyRow(from.store_values.data() + at,
              in.values[r.kv_head].data() + static_cast<size_t>(r.row) * head_dim_, head_dim_);
    }
  });
  in.active = true;
  return Status::Ok();
}

CompactSegment SplitByHeadKv::Front(int layer) const {
  const Layer& l = layers_[static_cast<size_t>(layer)];
  CompactSegment segment;
  segment.view.keys = const_cast<float*>(l.front_keys.data());
  segment.view.values = const_cast<float*>(l.front_values.data());
  segment.view.num_kv_heads = kv_heads_;
  segment.view.capacity = l.front_capacity;
  segment.view.head_dim = head_dim_;
  segment.counts = l.counts.data();
  return segment;
}

int64_t SplitByHeadKv::LocalBytes(int layer, int position) const {
  const Layer& l = layers_[static_cast<size_t>(layer)];
  int64_t rows = 0;
  for (int h = 0; h < kv_heads_; ++h) {
    rows += split_.IsRepresentative(layer, h)
                ? position + 1
                : l.counts[static_cast<size_t>(h)] + (position + 1 - l.recent_begin);
  }
  return rows * 2 * head_dim_ * static_cast<int64_t>(sizeof(float));
}

int64_t SplitByHeadKv::FullBytes(int position) const {
  return static_cast<int64_t>(position + 1) * kv_heads_ * 2 * head_dim_ *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace rubato
