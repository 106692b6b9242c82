// Open-addressing hash indexes for the BPE vocabulary and merge table. Real vocabularies have
// 100k-300k entries; node-based std::unordered_map spends most of tokenizer loading (and much of
// encoding) on cache misses, these flat tables touch one or two cache lines per lookup.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rubato {

// token string -> id, over a table of token strings indexed by id (held by the owner).
class TokenIndex {
 public:
  // Indexes every `tokens[id]` with `present[id]`; `tokens` must outlive the index and not move.
  // Returns the first id whose string repeats an earlier one, or -1.
  int Build(const std::vector<std::string>* tokens, const std::vector<bool>& present);
  // The id of `token`, or -1.
  int Find(std::string_view token) const;

 private:
  struct Slot {
    uint32_t hash;
    int32_t id;  // -1: empty
  };
  std::vector<Slot> slots_;  // size is a power of two, at most half full
  const std::vector<std::string>* tokens_ = nullptr;
};

// (left id, right id) -> (merge rank, merged id).
class MergeIndex {
 public:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  void Reserve(size_t count);
  // Inserts or replaces (a repeated pair keeps its last rank, like HF).
  void Insert(int32_t left, int32_t right, Merge merge);
  // The merge of the pair, or nullptr.
  const Merge* Find(int32_t left, int32_t right) const;

 private:
  struct Slot {
    uint64_t key;  // kEmptyKey: empty
    Merge merge;
  };
  static constexpr uint64_t kEmptyKey = ~uint64_t{0};
  void Grow();
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace rubato
