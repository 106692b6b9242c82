// The `model` section of tokenizer.json for type "BPE": vocab, ranked merges and the options that
// change how a word is split, reproducing Hugging Face tokenizers' BPE::tokenize:
//   * a word is cut into characters (with continuing_subword_prefix / end_of_word_suffix when
//     set), characters missing from the vocab go to byte_fallback tokens "<0xAB>" or unk_token,
//     or are dropped when neither is configured (as HF does);
//   * merges are applied lowest rank first (ties: leftmost), with HF's priority queue;
//   * ignore_merges (Llama-3): a word that is itself in the vocab is one token.
// Merges may be written "a b" or ["a", "b"]. dropout must be null or 0 (encoding must be
// deterministic). Results for short words are cached; the cache is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/json_reader.h"
#include "common/tokenizer/string_map.h"
#include "common/tokenizer/vocab_index.h"

namespace rubato {

class BpeModel {
 public:
  // Ids may leave holes, but an id this far beyond the number of tokens is taken for a broken
  // file (tables are indexed by id).
  static constexpr size_t kMaxIdGap = size_t{1} << 20;

  // `model` is the tokenizer.json "model" object (already checked to be of type BPE).
  static Result<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model,
                                                    const JsonReader& reader);

  // Appends the ids of one pre-tokenized word.
  void Tokenize(std::string_view word, std::vector<int>* ids) const;

  std::optional<int> TokenToId(std::string_view token) const;
  // The vocab string of `id`, or nullptr when the vocab has no such id.
  const std::string* IdToToken(int id) const;
  // One past the largest vocab id.
  int id_limit() const { return static_cast<int>(id_to_token_.size()); }

 private:
  Status LoadVocab(const nlohmann::json& vocab, const JsonReader& reader);
  Status LoadMerges(const nlohmann::json& merges, const JsonReader& reader);
  // Splits `word` into vocab symbols and applies the merges (HF BPE::merge_word).
  void MergeWord(std::string_view word, std::vector<int>* ids) const;

  int FindId(std::string_view token) const { return vocab_.Find(token); }

  std::vector<std::string> id_to_token_;  // [id] -> token; "" where the vocab has a hole
  std::vector<bool> id_present_;          // [id] -> whether the vocab has this id
  // token -> id; refers to id_to_token_, so BpeModel is neither copied nor moved (it lives
  // behind a unique_ptr, and the cache mutex forbids both anyway).
  TokenIndex vocab_;
  MergeIndex merges_;  // (left id, right id) -> rank, merged id
  std::optional<int> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;

  // Word -> ids for words shorter than kCacheMaxWordBytes, at most kCacheCapacity entries.
  static constexpr size_t kCacheMaxWordBytes = 256;
  static constexpr size_t kCacheCapacity = 10000;
  mutable std::shared_mutex cache_mutex_;
  mutable StringMap<std::vector<int>> cache_;
};

}  // namespace rubato
