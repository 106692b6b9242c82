// Batched next-token sampling on the GPU (sampling.cuh): kernels, launcher, validation. One
// block per row: greedy is a block-wide argmax; a sampled row reproduces the CPU's
// SampleTokenWithUniform without sorting the vocabulary (radix selects and prefix scans over the
// top-k candidates, exact 64-bit fixed-point masses independent of scheduling).
// The steps and the error bound versus the CPU: docs/cuda_model.md "Sampling".
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/sampling.cuh"

namespace rubato::cuda {
namespace {

using u64 = unsigned long long;  // the 64-bit type CUDA's atomics and shuffles take

constexpr int kThreads = 512;  // one block per row (1024 would cap registers at 64: spills)
constexpr int kWarps = kThreads / 32;
constexpr int kPerThread = 8;  // consecutive candidates per thread: two 16-byte loads in flight
constexpr int kTile = kPerThread * kThreads;  // candidates per block-wide step
constexpr int kDigitBits = 8;                 // radix select: 4 passes over 32-bit keys
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerLane = kBins / 32;
static_assert(kThreads >= kBins, "one thread per bin sums the histogram replicas");
constexpr int kCopies = 8;  // histogram replicas (lane % 8): fewer atomics on one address
// A radix select whose remaining candidates fit in this many moves them to a scratch list after
// the pass that finds so (typically the first: few logits share the top bin of a peaked row), so
// its later passes and its tie walk read one tile instead of the row.
constexpr int kNarrowCapacity = kTile;
constexpr int kMaxVocab = 1 << 26;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint32_t kNegInfKey = 0x007fffffu;  // OrderedKey(-inf)

// ---- keys: floats as order-preserving unsigned integers -----------------------------------------

// a > b  <=>  OrderedKey(a) > OrderedKey(b) for non-NaN floats; -0 maps like +0 because the CPU
// compares values (-0 == +0: the lower id wins).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) == 0) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The key sampling orders by: NaN (outside the contract) sorts as -inf.
__device__ __forceinline__ uint32_t SampleKey(float x) {
  return isnan(x) ? kNegInfKey : OrderedKey(x);
}

__device__ __forceinline__ float KeyValue(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// (key, id) packed so that the larger pack is the larger logit, then the lower id.
__device__ __forceinline__ u64 PackKeyId(uint32_t key, int id) {
  return (static_cast<u64>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ int PackedId(u64 packed) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(packed & 0xffffffffu));
}

// ---- shared state and block-wide primitives -----------------------------------------------------

struct SharedState {
  // Radix histogram [bin][copy]: weights of the candidates whose key has the selected prefix and
  // `bin` as its next digit; copy = lane % kCopies.
  u64 hist[kBins * kCopies];
  u64 bins[kBins];  // [bin]: hist summed over the copies
  // The same for the number of candidates of positive weight (radix select narrowing).
  unsigned counts[kBins * kCopies];
  unsigned bin_counts[kBins];
  // Per-warp partials of the block reductions and scans, one array per type.
  u64 warp_u64[kWarps];
  double warp_f64[kWarps];
  int warp_int[kWarps];
  // Broadcasts from one thread to the block.
  u64 found_before;  // radix select: weight of the candidates above the selected bin
  u64 found_target;  // radix select: the target, clamped to the total weight
  int found_bin;
  unsigned found_count;  // radix select: candidates of positive weight in the selected bin
  int hit_id;            // prefix scans: the token id at the hit ...
  u64 hit_u64;           // ... and the inclusive prefix there
  double hit_f64;
};

__device__ __forceinline__ u64* WarpScratch(SharedState& sh, u64) { return sh.warp_u64; }
__device__ __forceinline__ double* WarpScratch(SharedState& sh, double) { return sh.warp_f64; }
__device__ __forceinline__ int* WarpScratch(SharedState& sh, int) { return sh.warp_int; }
__device__ __forceinline__ u64& HitSlot(SharedState& sh, u64) { return sh.hit_u64; }
__device__ __forceinline__ double& HitSlot(SharedState& sh, double) { return sh.hit_f64; }

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b ? a : b;
  }
};

// The reduction of `value` over the block; every thread gets the same bits (every thread combines
// the warp partials in the same order).
template <typename T, typename Op>
__device__ T BlockReduce(T value, Op op, SharedState& sh) {
  T* scratch = WarpScratch(sh, T{});
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = op(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  T result = scratch[0];
  for (int w = 1; w < kWarps; ++w) result = op(result, scratch[w]);
  __syncthreads();  // the scratch is free again
  return result;
}

// The sum of `value` over the threads before this one, and in `total` over the whole block.
template <typename T>
__device__ T BlockExclusiveScan(T value, T& total, SharedState& sh) {
  T* scratch = WarpScratch(sh, T{});
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  T exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) exclusive = T{};
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  T before{};
  total = T{};
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = total;
    total += scratch[w];
  }
  __syncthreads();
  return before + exclusive;
}

// ---- candidates ---------------------------------------------------------------------------------

// The tokens a pass walks, in increasing id order: the whole row, or after top-k the kept ids.
struct Candidates {
  const float* logits;  // [vocab] the row's logits, f32
  const int* ids;       // [count] increasing token ids (workspace, 16-byte aligned), or nullptr
                        // for ids 0..count-1
  float* probs;  // [RoundUp(count, kPerThread)] f32 probability of each candidate (workspace,
                 // 16-byte aligned; the padding is written as 0)
  int count;
  bool logits_aligned;  // the row starts 16 bytes aligned: contiguous logits load as float4
};

// Candidates [e, e + kPerThread): their token ids (-1 past the end) and logits.
__device__ __forceinline__ void LoadCandidates(const Candidates& c, int e, int (&id)[kPerThread],
                                               float (&logit)[kPerThread]) {
  const bool full = e + kPerThread <= c.count;
  if (c.ids == nullptr) {
    if (c.logits_aligned && full) {
#pragma unroll
      for (int v = 0; v < kPerThread; v += 4) {
        const float4 q = *reinterpret_cast<const float4*>(c.logits + e + v);
        logit[v] = q.x, logit[v + 1] = q.y, logit[v + 2] = q.z, logit[v + 3] = q.w;
      }
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) id[j] = e + j;
      return;
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) id[j] = e + j < c.count ? e + j : -1;
  } else if (full) {
#pragma unroll
    for (int v = 0; v < kPerThread; v += 4) {
      const int4 q = *reinterpret_cast<const int4*>(c.ids + e + v);
      id[v] = q.x, id[v + 1] = q.y, id[v + 2] = q.z, id[v + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) id[j] = e + j < c.count ? c.ids[e + j] : -1;
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) logit[j] = id[j] >= 0 ? c.logits[id[j]] : 0.f;
}

// Probabilities of candidates [e, e + kPerThread) (0 past the end: the arrays are padded to a
// multiple of kPerThread, and nothing is read for e >= count).
__device__ __forceinline__ void LoadProbs(const Candidates& c, int e, float (&prob)[kPerThread]) {
#pragma unroll
  for (int v = 0; v < kPerThread; v += 4) {
    const float4 q = e < c.count ? *reinterpret_cast<const float4*>(c.probs + e + v)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
    prob[v] = q.x, prob[v + 1] = q.y, prob[v + 2] = q.z, prob[v + 3] = q.w;
  }
}

// Weights of the radix select and the prefix scans: operator()(key, prob). kUsesProbs: read the
// probabilities (only after the probability pass wrote them).
struct CountWeight {
  static constexpr bool kUsesProbs = false;
  __device__ u64 operator()(uint32_t, float) const { return 1; }
};
struct FixedMass {  // probability * 2^shift, rounded
  static constexpr bool kUsesProbs = true;
  float scale;
  __device__ u64 operator()(uint32_t, float prob) const { return __float2ull_rn(prob * scale); }
};
struct Probability {
  static constexpr bool kUsesProbs = true;
  __device__ double operator()(uint32_t, float prob) const { return prob; }
};
template <typename Weight>
struct TiedWeight {  // Weight for the candidates whose key is `key`, else 0
  static constexpr bool kUsesProbs = Weight::kUsesProbs;
  uint32_t key;
  Weight weight;
  __device__ u64 operator()(uint32_t k, float prob) const { return k == key ? weight(k, prob) : 0; }
};

// ---- passes -------------------------------------------------------------------------------------

// Calls visit(id, logit) for this thread's candidates, kPerThread consecutive ones per tile
// (ids past the end skipped).
template <typename Visit>
__device__ __forceinline__ void ForEachCandidate(const Candidates& c, Visit visit) {
  for (int e = kPerThread * static_cast<int>(threadIdx.x); e < c.count; e += kTile) {
    int id[kPerThread];
    float logit[kPerThread];
    LoadCandidates(c, e, id, logit);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (id[j] >= 0) visit(id[j], logit[j]);
    }
  }
}

// The largest logit and the lowest id holding it, packed (PackKeyId); 0 if none. skip_nan: ArgMax
// semantics (NaN is never chosen); else NaN counts as -inf.
__device__ u64 RowMax(const Candidates& c, bool skip_nan, SharedState& sh) {
  u64 best = 0;
  ForEachCandidate(c, [&](int id, float logit) {
    if (skip_nan && isnan(logit)) return;
    const u64 packed = PackKeyId(SampleKey(logit), id);
    best = packed > best ? packed : best;
  });
  return BlockReduce(best, MaxOp{}, sh);
}

// The first candidate in id order where the running sum of weight() exceeds `threshold` (and whose
// own weight is positive: with fp64 sums, block-wide rounding cannot make a weightless candidate
// the hit). Returns its token id (-1 if none) and the running sum there (the total if none).
template <typename T>
struct IdHit {
  int id;
  T inclusive;
};
template <typename T, typename Weight>
__device__ IdHit<T> FirstPrefixAbove(const Candidates& c, T threshold, const Weight& weight,
                                     SharedState& sh) {
  T carry{};
  for (int base = 0; base < c.count; base += kTile) {
    const int e = base + kPerThread * static_cast<int>(threadIdx.x);
    int id[kPerThread];
    float logit[kPerThread], prob[kPerThread] = {};
    LoadCandidates(c, e, id, logit);  // ids -1 past the end
    if (Weight::kUsesProbs) LoadProbs(c, e, prob);
    T w[kPerThread], local{};
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      w[j] = id[j] >= 0 ? static_cast<T>(weight(SampleKey(logit[j]), prob[j])) : T{};
      local += w[j];
    }
    T tile_total;
    T running = carry + BlockExclusiveScan(local, tile_total, sh);
    int hit = INT_MAX;  // position e + j, increasing with the token id
    int hit_id = -1;
    T hit_inclusive{};
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      running += w[j];
      if (hit == INT_MAX && w[j] > T{} && running > threshold) {
        hit = e + j;
        hit_id = id[j];
        hit_inclusive = running;
      }
    }
    const int first = BlockReduce(hit, MinOp{}, sh);
    if (first != INT_MAX) {  // the same value in every thread: the block leaves together
      if (hit == first) {
        sh.hit_id = hit_id;
        HitSlot(sh, T{}) = hit_inclusive;
      }
      __syncthreads();
      const IdHit<T> result{sh.hit_id, HitSlot(sh, T{})};
      __syncthreads();
      return result;
    }
    carry += tile_total;
  }
  return {-1, carry};
}

// What a radix select looks for: in sorted order (decreasing key, then increasing id), the first
// candidate whose cumulative weight reaches the target. target = absolute when nonzero, else from
// the total weight: ceil(fraction * total) (reach: the top-p cut, CPU cumulative >= top_p) or
// floor(fraction * total) + 1 (exceed: the draw, CPU uniform < cumulative). Clamped to
// [1, total].
struct Target {
  u64 absolute = 0;
  double fraction = 0.0;
  bool exceed = false;
};

struct RadixHit {
  uint32_t key;     // the key of the candidate the target falls on
  u64 before;       // total weight of the candidates with larger keys
  u64 target;       // the clamped target
  Candidates walk;  // where the tie walk looks: the candidates, or the narrowed list
};

// Scratch for a narrowed candidate list (workspace): ids [kNarrowCapacity] int32 and their
// probabilities [kNarrowCapacity] f32, both 16-byte aligned.
struct NarrowScratch {
  int* ids;
  float* probs;
};

// The candidates whose key matches `prefix` under `mask` and whose weight is positive (the only
// ones a radix select or tie walk can still land on), copied in id order into `scratch`.
template <typename Weight>
__device__ Candidates Narrow(const Candidates& c, uint32_t prefix, uint32_t mask,
                             const Weight& weight, NarrowScratch scratch, SharedState& sh) {
  int carry = 0;
  for (int base = 0; base < c.count; base += kTile) {
    const int e = base + kPerThread * static_cast<int>(threadIdx.x);
    int id[kPerThread];
    float logit[kPerThread], prob[kPerThread] = {};
    LoadCandidates(c, e, id, logit);  // ids -1 past the end
    if (Weight::kUsesProbs) LoadProbs(c, e, prob);
    bool keep[kPerThread];
    int local = 0;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t key = SampleKey(logit[j]);
      keep[j] = id[j] >= 0 && (key & mask) == prefix && weight(key, prob[j]) != 0;
      local += keep[j];
    }
    int tile_total;
    int position = carry + BlockExclusiveScan(local, tile_total, sh);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (!keep[j]) continue;
      if (position < kNarrowCapacity) {  // always: position < found_count <= kNarrowCapacity
        scratch.ids[position] = id[j];
        scratch.probs[position] = prob[j];
      }
      ++position;
    }
    carry += tile_total;
  }
  const int count = carry < kNarrowCapacity ? carry : kNarrowCapacity;
  // Zero the probabilities up to the next multiple of kPerThread, which LoadProbs reads.
  if (static_cast<int>(threadIdx.x) < (kPerThread - count % kPerThread) % kPerThread) {
    scratch.probs[count + static_cast<int>(threadIdx.x)] = 0.f;
  }
  __syncthreads();  // the list is read by other threads next
  return Candidates{c.logits, scratch.ids, scratch.probs, count, c.logits_aligned};
}

// Finds the key of the target candidate, 8 bits per pass from the top: each pass histograms the
// weights of the candidates that match the prefix found so far by their next digit, and walks the
// bins from the highest down to the one the target falls in.
template <typename Weight>
__device__ RadixHit RadixSelect(Candidates c, Target target_rule, const Weight& weight,
                                NarrowScratch scratch, SharedState& sh) {
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t prefix = 0, mask = 0;
  u64 before = 0, target = target_rule.absolute;
  bool narrowed = false;
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int b = tid; b < kBins * kCopies; b += kThreads) {
      sh.hist[b] = 0;
      sh.counts[b] = 0;
    }
    __syncthreads();
    u64* hist = sh.hist + tid % kCopies;
    unsigned* counts = sh.counts + tid % kCopies;
    for (int e = kPerThread * tid; e < c.count; e += kTile) {
      int id[kPerThread];
      float logit[kPerThread], prob[kPerThread] = {};
      LoadCandidates(c, e, id, logit);
      if (Weight::kUsesProbs) LoadProbs(c, e, prob);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        if (id[j] < 0) continue;
        const uint32_t key = SampleKey(logit[j]);
        if ((key & mask) != prefix) continue;
        const u64 w = weight(key, prob[j]);
        if (w == 0) continue;
        const int slot = static_cast<int>((key >> shift) & (kBins - 1)) * kCopies;
        atomicAdd(hist + slot, w);
        atomicAdd(counts + slot, 1u);
      }
    }
    __syncthreads();
    if (tid < kBins) {
      u64 sum = 0;
      unsigned count = 0;
      for (int copy = 0; copy < kCopies; ++copy) {
        sum += sh.hist[tid * kCopies + copy];
        count += sh.counts[tid * kCopies + copy];
      }
      sh.bins[tid] = sum;
      sh.bin_counts[tid] = count;
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l walks bins kBins-1-8l down to kBins-8-8l: the warp walks all bins from the top.
      u64 local = 0;
      for (int r = 0; r < kBinsPerLane; ++r) local += sh.bins[kBins - 1 - (tid * kBinsPerLane + r)];
      u64 inclusive = local;
      for (int offset = 1; offset < 32; offset <<= 1) {
        const u64 up = __shfl_up_sync(kFullMask, inclusive, offset);
        if (tid >= offset) inclusive += up;
      }
      const u64 total = before + __shfl_sync(kFullMask, inclusive, 31);
      u64 t = target;
      if (t == 0) {  // first pass: the total of this pass is the total weight
        const double x = fmax(target_rule.fraction, 0.0) * static_cast<double>(total);
        t = target_rule.exceed ? static_cast<u64>(floor(x)) + 1 : static_cast<u64>(ceil(x));
      }
      t = t > total ? total : t;
      t = t < 1 ? 1 : t;
      if (tid == 0) {  // unreachable fallback (no weight at all): the lowest bin
        sh.found_bin = 0;
        sh.found_before = before;
        sh.found_target = t;
        sh.found_count = 0;
      }
      __syncwarp();
      u64 running = before + inclusive - local;
      for (int r = 0; r < kBinsPerLane; ++r) {
        const int bin = kBins - 1 - (tid * kBinsPerLane + r);
        const u64 w = sh.bins[bin];
        if (running < t && running + w >= t) {  // exactly one bin: integer sums are exact
          sh.found_bin = bin;
          sh.found_before = running;
          sh.found_count = sh.bin_counts[bin];
        }
        running += w;
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.found_bin) << shift;
    mask |= static_cast<uint32_t>(kBins - 1) << shift;
    before = sh.found_before;
    target = sh.found_target;
    const int remaining = static_cast<int>(sh.found_count);
    if (!narrowed && remaining <= kNarrowCapacity && remaining < c.count) {
      c = Narrow(c, prefix, mask, weight, scratch, sh);
      narrowed = true;
    }
  }
  return {prefix, before, target, c};
}

// The token of a radix select: among the candidates with the selected key, in id order, the one
// where the cumulative weight reaches target - before. Returns it (-1 if none, which cannot
// happen) with the cumulative weight of the sorted order up to and including it.
template <typename Weight>
__device__ IdHit<u64> TieWalk(const RadixHit& hit, const Weight& weight, SharedState& sh) {
  const TiedWeight<Weight> tied{hit.key, weight};
  IdHit<u64> result = FirstPrefixAbove<u64>(hit.walk, hit.target - hit.before - 1, tied, sh);
  result.inclusive += hit.before;
  return result;
}

// Compacts the top-k ids, increasing, to `out` [k]: the candidates with keys above `cut_key`, and
// of those with key == cut_key the first `ties_kept` in id order (CPU: lower id first on ties).
__device__ void CompactTopK(const Candidates& c, uint32_t cut_key, u64 ties_kept, int* out,
                            SharedState& sh) {
  constexpr u64 kAbove = u64{1} << 32;  // counts packed as (above << 32) | tied: one scan
  u64 carry = 0;
  for (int base = 0; base < c.count; base += kTile) {
    const int e = base + kPerThread * static_cast<int>(threadIdx.x);
    int id[kPerThread];
    float logit[kPerThread];
    LoadCandidates(c, e, id, logit);  // ids -1 past the end
    u64 flag[kPerThread], local = 0;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t key = SampleKey(logit[j]);
      flag[j] = id[j] < 0 ? 0 : key > cut_key ? kAbove : key == cut_key ? 1 : 0;
      local += flag[j];
    }
    u64 tile_total;
    u64 running = carry + BlockExclusiveScan(local, tile_total, sh);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const u64 above = running >> 32, tied = running & 0xffffffffu;
      if (flag[j] == kAbove || (flag[j] == 1 && tied < ties_kept)) {
        out[above + (tied < ties_kept ? tied : ties_kept)] = id[j];
      }
      running += flag[j];
    }
    carry += tile_total;
  }
  __syncthreads();  // `out` is read by other threads next
}

// Writes the probability of every candidate, exp(l/T - max/T) computed in double like the CPU,
// as f32 (the padding up to a multiple of kPerThread as 0). Returns their total (fp64) and, in
// last_positive, the highest token id with a positive probability (-1 if none).
__device__ double WriteProbabilities(const Candidates& c, float temperature, float max_scaled,
                                     int& last_positive, SharedState& sh) {
  double total = 0.0;
  int last = -1;
  for (int e = kPerThread * static_cast<int>(threadIdx.x); e < c.count; e += kTile) {
    int id[kPerThread];
    float logit[kPerThread], prob[kPerThread];
    LoadCandidates(c, e, id, logit);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const float scaled = __fdiv_rn(logit[j], temperature);  // the CPU's f32 division
      const double p = exp(static_cast<double>(scaled) - static_cast<double>(max_scaled));
      prob[j] = id[j] >= 0 && p > 0.0 ? __double2float_rn(p) : 0.f;  // NaN (no contract) -> 0
      total += prob[j];
      if (prob[j] > 0.f) last = id[j];
    }
#pragma unroll
    for (int v = 0; v < kPerThread; v += 4) {  // incl. the padding up to a multiple of kPerThread
      *reinterpret_cast<float4*>(c.probs + e + v) =
          make_float4(prob[v], prob[v + 1], prob[v + 2], prob[v + 3]);
    }
  }
  last_positive = BlockReduce(last, MaxOp{}, sh);  // also orders the stores before later reads
  return BlockReduce(total, SumOp{}, sh);
}

// ---- rows ---------------------------------------------------------------------------------------

// Greedy: kernels/cpu ArgMax (lowest id among equal maxima; NaN never chosen unless all are
// NaN, then 0), from the row's RowMax(skip_nan = true).
__device__ int GreedyToken(u64 best) { return best == 0 ? 0 : PackedId(best); }

// The largest logit of a RowMax result (either NaN mode: NaN counts as -inf or not at all);
// NaN when the row had no candidate.
__device__ float MaxLogit(u64 best) {
  return best == 0 ? NAN : KeyValue(static_cast<uint32_t>(best >> 32));
}

// kernels/cpu SampleTokenWithUniform (see the file comment for the steps); best: the row's
// RowMax(skip_nan = false).
__device__ int SampleRow(Candidates c, const SamplingRow& rp, u64 best, int* kept_ids,
                         NarrowScratch scratch, SharedState& sh) {
  const int best_id = PackedId(best);
  const float max_logit = MaxLogit(best);
  if (!isfinite(max_logit)) return best_id;  // no finite logit, or +inf: outside the contract
  const float max_scaled = __fdiv_rn(max_logit, rp.temperature);
  const bool top_k = rp.top_k > 0 && rp.top_k < c.count;
  const bool top_p = rp.top_p < 1.f;

  if (top_k) {
    const RadixHit cut =
        RadixSelect(c, Target{static_cast<u64>(rp.top_k)}, CountWeight{}, scratch, sh);
    CompactTopK(c, cut.key, cut.target - cut.before, kept_ids, sh);
    c.ids = kept_ids;
    c.count = rp.top_k;
  }
  int last_positive = -1;
  const double total = WriteProbabilities(c, rp.temperature, max_scaled, last_positive, sh);
  if (!(total > 0.0)) return best_id;  // outside the contract (e.g. a denormal temperature)
  const double uniform = fmin(fmax(rp.uniform, 0.0), 1.0);  // fmax: NaN -> 0

  if (!top_k && !top_p) {  // the CPU walks ids in order
    const IdHit<double> hit = FirstPrefixAbove<double>(c, uniform * total, Probability{}, sh);
    return hit.id >= 0 ? hit.id : last_positive;
  }

  // Sorted walk in fixed point: total * 2^shift < 2^62 (total >= 1: the largest probability is 1).
  const FixedMass mass{scalbnf(1.f, 61 - ilogb(total))};
  Target draw{0, uniform, /*exceed=*/true};
  if (top_p) {
    const RadixHit cut = RadixSelect(c, Target{0, rp.top_p, /*exceed=*/false}, mass, scratch, sh);
    const IdHit<u64> last = TieWalk(cut, mass, sh);
    const u64 nucleus = last.id >= 0 ? last.inclusive : cut.target;  // fixed-point mass
    const u64 pick = static_cast<u64>(uniform * static_cast<double>(nucleus)) + 1;
    draw.absolute = pick < nucleus ? pick : nucleus;
  }
  const RadixHit pick = RadixSelect(c, draw, mass, scratch, sh);
  const IdHit<u64> token = TieWalk(pick, mass, sh);
  return token.id >= 0 ? token.id : best_id;
}

// kernels/cpu TokenProbability: softmax(row)[token] at temperature 1 over the non-NaN logits, the
// sum in double (block order, not the CPU's: the two agree to ~1e-12 relative, then f32 rounding).
// max_logit: MaxLogit of the row's RowMax (the largest non-NaN logit in both NaN modes).
__device__ float TokenProbability(const Candidates& row, int token, float max_logit,
                                  SharedState& sh) {
  const float token_logit = row.logits[token];
  if (!isfinite(max_logit) || isnan(token_logit)) return 0.f;  // uniform over the block
  double local = 0.0;
  ForEachCandidate(row, [&](int, float logit) {
    if (!isnan(logit)) local += exp(static_cast<double>(logit) - static_cast<double>(max_logit));
  });
  const double total = BlockReduce(local, SumOp{}, sh);
  return static_cast<float>(exp(static_cast<double>(token_logit) - max_logit) / total);
}

// ---- kernel -------------------------------------------------------------------------------------

// Workspace per row, in 4-byte words (multiples of kPerThread, so every array is 16-byte
// aligned and padded for LoadProbs): probabilities [stride] f32, kept top-k ids [stride] int32,
// narrowed ids [kNarrowCapacity] int32, narrowed probabilities [kNarrowCapacity] f32; stride =
// vocab rounded up to kPerThread.
__host__ __device__ inline size_t VocabStride(int vocab_size) {
  return (static_cast<size_t>(vocab_size) + kPerThread - 1) / kPerThread * kPerThread;
}
__host__ __device__ inline size_t WorkspaceWordsPerRow(int vocab_size) {
  return 2 * VocabStride(vocab_size) + 2 * static_cast<size_t>(kNarrowCapacity);
}

// Block b samples row b.
__global__ void __launch_bounds__(kThreads) SampleKernel(SampleParams p) {
  __shared__ SharedState sh;
  const int row = static_cast<int>(blockIdx.x);
  const size_t stride = VocabStride(p.vocab_size);
  float* probs = static_cast<float*>(p.workspace) + row * WorkspaceWordsPerRow(p.vocab_size);
  int* kept_ids = reinterpret_cast<int*>(probs + stride);
  const NarrowScratch scratch{kept_ids + stride, probs + 2 * stride + kNarrowCapacity};
  const float* logits = p.logits + static_cast<size_t>(row) * p.vocab_size;
  const Candidates candidates{logits, nullptr, probs, p.vocab_size,
                              reinterpret_cast<uintptr_t>(logits) % 16 == 0};
  const SamplingRow rp = p.row_params[row];
  // temperature <= 0 or NaN (outside the contract) is greedy too. One pass finds the row's
  // maximum for the token and for its probability.
  const bool greedy = !(rp.temperature > 0.f);
  const u64 best = RowMax(candidates, /*skip_nan=*/greedy, sh);
  const int token =
      greedy ? GreedyToken(best) : SampleRow(candidates, rp, best, kept_ids, scratch, sh);
  if (threadIdx.x == 0) p.tokens[row] = token;
  if (p.probabilities != nullptr) {
    const float probability =
        rp.report_probability != 0 ? TokenProbability(candidates, token, MaxLogit(best), sh) : -1.f;
    if (threadIdx.x == 0) p.probabilities[row] = probability;
  }
}

Status Validate(const SampleParams& p);

}  // namespace

// ---- launcher -----------------------------------------------------------------------------------

size_t SampleWorkspaceBytes(int rows, int vocab_size) {
  if (rows <= 0 || vocab_size <= 0) return 0;
  return static_cast<size_t>(rows) * WorkspaceWordsPerRow(vocab_size) * sizeof(float);
}

Status SampleTokens(const SampleParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.rows == 0) return Status::Ok();
  SampleKernel<<<params.rows, kThreads, 0, stream>>>(params);
  return LaunchStatus("sample_tokens");
}

namespace {

// ---- validation ---------------------------------------------------------------------------------

// Row parameters live on the device and are not checked here (that would need a copy back): the
// kernel treats temperature <= 0 as greedy, top_k outside (0, vocab) and top_p >= 1 as off, and
// clamps the uniform to [0, 1].
Status Validate(const SampleParams& p) {
  if (p.rows < 0) {
    return InvalidArgumentError("SampleTokens: rows " + std::to_string(p.rows) + " is negative");
  }
  if (p.rows == 0) return Status::Ok();  // nothing to sample; the pointers may be null
  if (p.vocab_size < 1 || p.vocab_size > kMaxVocab) {
    return InvalidArgumentError("SampleTokens: vocab_size " + std::to_string(p.vocab_size) +
                                " must be in [1, " + std::to_string(kMaxVocab) + "]");
  }
  if (p.logits == nullptr) return InvalidArgumentError("SampleTokens: logits is null");
  if (p.row_params == nullptr) return InvalidArgumentError("SampleTokens: row_params is null");
  if (p.tokens == nullptr) return InvalidArgumentError("SampleTokens: tokens is null");
  if (p.workspace == nullptr) return InvalidArgumentError("SampleTokens: workspace is null");
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) {
    return InvalidArgumentError("SampleTokens: workspace must be 16-byte aligned");
  }
  const size_t needed = SampleWorkspaceBytes(p.rows, p.vocab_size);
  if (p.workspace_bytes < needed) {
    return InvalidArgumentError(
        "SampleTokens: workspace_bytes " + std::to_string(p.workspace_bytes) + " is below the " +
        std::to_string(needed) + " SampleWorkspaceBytes(" + std::to_string(p.rows) + ", " +
        std::to_string(p.vocab_size) + ") asks for");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
