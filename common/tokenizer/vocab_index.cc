// Flat hash indexes for vocabularies and merges (linear probing, power-of-two tables).
#include "common/tokenizer/vocab_index.h"

#include <algorithm>
#include <bit>

namespace rubato {

namespace {

// FNV-1a, folded; fast for short token strings.
uint32_t HashString(std::string_view s) {
  uint64_t h = 1469598103934665603ULL;
  for (const char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ULL;
  }
  return static_cast<uint32_t>(h ^ (h >> 32));
}

// A 64-bit finalizer (splitmix64) so that consecutive ids spread over the table.
uint64_t HashPair(uint64_t key) {
  key ^= key >> 30;
  key *= 0xbf58476d1ce4e5b9ULL;
  key ^= key >> 27;
  key *= 0x94d049bb133111ebULL;
  key ^= key >> 31;
  return key;
}

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

int TokenIndex::Build(const std::vector<std::string>* tokens, const std::vector<bool>& present) {
  tokens_ = tokens;
  const size_t capacity = std::bit_ceil(std::max<size_t>(16, tokens->size() * 2));
  slots_.assign(capacity, Slot{0, -1});
  const size_t mask = capacity - 1;
  for (size_t id = 0; id < tokens->size(); ++id) {
    if (!present[id]) continue;
    const std::string& token = (*tokens)[id];
    const uint32_t hash = HashString(token);
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      Slot& slot = slots_[i];
      if (slot.id < 0) {
        slot = Slot{hash, static_cast<int32_t>(id)};
        break;
      }
      if (slot.hash == hash && (*tokens)[slot.id] == token) return static_cast<int>(id);
    }
  }
  return -1;
}

int TokenIndex::Find(std::string_view token) const {
  if (slots_.empty()) return -1;
  const size_t mask = slots_.size() - 1;
  const uint32_t hash = HashString(token);
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& slot = slots_[i];
    if (slot.id < 0) return -1;
    if (slot.hash == hash && (*tokens_)[slot.id] == token) return slot.id;
  }
}

void MergeIndex::Reserve(size_t count) {
  const size_t capacity = std::bit_ceil(std::max<size_t>(16, count * 2));
  if (capacity <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(capacity, Slot{kEmptyKey, {0, 0}});
  size_ = 0;
  for (const Slot& slot : old) {
    if (slot.key != kEmptyKey) {
      Insert(static_cast<int32_t>(slot.key >> 32), static_cast<int32_t>(slot.key & 0xFFFFFFFF),
             slot.merge);
    }
  }
}

void MergeIndex::Grow() { Reserve(std::max<size_t>(16, slots_.size())); }

void MergeIndex::Insert(int32_t left, int32_t right, Merge merge) {
  if ((size_ + 1) * 2 > slots_.size()) Grow();
  const uint64_t key = PairKey(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = HashPair(key) & mask;; i = (i + 1) & mask) {
    Slot& slot = slots_[i];
    if (slot.key == kEmptyKey) {
      slot = Slot{key, merge};
      ++size_;
      return;
    }
    if (slot.key == key) {
      slot.merge = merge;
      return;
    }
  }
}

const MergeIndex::Merge* MergeIndex::Find(int32_t left, int32_t right) const {
  if (slots_.empty()) return nullptr;
  const uint64_t key = PairKey(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = HashPair(key) & mask;; i = (i + 1) & mask) {
    const Slot& slot = slots_[i];
    if (slot.key == kEmptyKey) return nullptr;
    if (slot.key == key) return &slot.merge;
  }
}

}  // namespace rubato
