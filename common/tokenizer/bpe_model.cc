// BPE model: vocab and merges from tokenizer.json, and the word merge loop of HF tokenizers.
#include "common/tokenizer/bpe_model.h"

#include <fmt/format.h>

#include <queue>

#include "common/tokenizer/utf8_text.h"

namespace rubato {

namespace {

// One symbol of a word during merging, in a doubly linked list over a vector (HF `Symbol`).
struct Symbol {
  int id;
  int prev;  // index of the previous live symbol, -1 at the start
  int next;  // index of the next live symbol, -1 at the end
  bool alive;
};

struct QueuedMerge {
  int pos;  // index of the left symbol
  int rank;
  int new_id;
};

// std::priority_queue pops the "largest": lowest rank first, then leftmost position.
struct MergeOrder {
  bool operator()(const QueuedMerge& a, const QueuedMerge& b) const {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.pos > b.pos;
  }
};

}  // namespace

Status BpeModel::LoadVocab(const nlohmann::json& vocab, const JsonReader& reader) {
  if (!vocab.is_object()) return reader.TypeError("model.vocab", "an object {token: id}", vocab);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const nlohmann::json& value = it.value();
    // Fast path for the common case; TokenId() produces the error message otherwise.
    int id = -1;
    if (value.is_number_unsigned() && value.get<uint64_t>() <= INT32_MAX) {
      id = static_cast<int>(value.get<uint64_t>());
    } else {
      RUBATO_ASSIGN_OR_RETURN(id,
                              reader.TokenId(value, fmt::format("model.vocab[\"{}\"]", it.key())));
    }
    if (static_cast<size_t>(id) >= vocab.size() + kMaxIdGap) {
      return reader.Error(
          StatusCode::kDataLoss, fmt::format("model.vocab[\"{}\"]", it.key()),
          fmt::format("id {} is far beyond the {} tokens of the vocab", id, vocab.size()));
    }
    if (static_cast<size_t>(id) >= id_to_token_.size()) {
      const size_t size = std::max<size_t>(id + 1, id_to_token_.size() * 3 / 2);
      id_to_token_.resize(size);
      id_present_.resize(size, false);
    }
    if (id_present_[id]) {
      return reader.Error(
          StatusCode::kDataLoss, "model.vocab",
          fmt::format("tokens '{}' and '{}' both have id {}", id_to_token_[id], it.key(), id));
    }
    id_present_[id] = true;
    id_to_token_[id] = it.key();
  }
  // Trim to one past the largest id.
  size_t limit = id_present_.size();
  while (limit > 0 && !id_present_[limit - 1]) --limit;
  id_to_token_.resize(limit);
  id_present_.resize(limit);
  id_to_token_.shrink_to_fit();
  vocab_.Build(&id_to_token_, id_present_);  // keys of a JSON object are unique
  return Status::Ok();
}

Status BpeModel::LoadMerges(const nlohmann::json& merges, const JsonReader& reader) {
  RUBATO_RETURN_IF_ERROR(reader.ExpectArray(merges, "model.merges"));
  merges_.Reserve(merges.size());
  std::string merged;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const nlohmann::json& entry = merges[rank];
    const std::string path = JsonPathIndex("model.merges", rank);
    std::string_view left, right;
    if (entry.is_string()) {
      // "a b": exactly one space (byte-level tokens never contain a plain space).
      const std::string& text = entry.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        return reader.Error(
            StatusCode::kDataLoss, path,
            fmt::format("merge \"{}\" is not two tokens separated by one space", text));
      }
      left = std::string_view(text).substr(0, space);
      right = std::string_view(text).substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {
      left = entry[0].get_ref<const std::string&>();
      right = entry[1].get_ref<const std::string&>();
    } else {
      return reader.TypeError(path, "a merge \"a b\" or a pair [\"a\", \"b\"]", entry);
    }
    const int left_id = FindId(left);
    const int right_id = FindId(right);
    if (left_id < 0 || right_id < 0) {
      return reader.Error(StatusCode::kDataLoss, path,
                          fmt::format("merge of '{}' and '{}' refers to '{}', which is not in "
                                      "model.vocab",
                                      left, right, left_id < 0 ? left : right));
    }
    if (right.size() < continuing_subword_prefix_.size()) {
      return reader.Error(StatusCode::kDataLoss, path,
                          fmt::format("merge right side '{}' is shorter than "
                                      "continuing_subword_prefix '{}'",
                                      right, continuing_subword_prefix_));
    }
    merged.assign(left);
    merged.append(right.substr(continuing_subword_prefix_.size()));
    const int merged_id = FindId(merged);
    if (merged_id < 0) {
      return reader.Error(StatusCode::kDataLoss, path,
                          fmt::format("merge of '{}' and '{}' makes '{}', which is not in "
                                      "model.vocab",
                                      left, right, merged));
    }
    // A repeated pair keeps its last rank, as HF's HashMap collect does.
    merges_.Insert(left_id, right_id, {static_cast<int32_t>(rank), merged_id});
  }
  return Status::Ok();
}

Result<std::unique_ptr<BpeModel>> BpeModel::FromJson(const nlohmann::json& model,
                                                     const JsonReader& reader) {
  auto bpe = std::make_unique<BpeModel>();
  if (const nlohmann::json* dropout = reader.OptionalField(model, "dropout")) {
    if (!dropout->is_number()) return reader.TypeError("model.dropout", "a number", *dropout);
    if (dropout->get<double>() != 0.0) {
      return reader.Error(StatusCode::kUnsupported, "model.dropout",
                          "BPE dropout is not supported (encoding must be deterministic); set "
                          "it to null");
    }
  }
  RUBATO_ASSIGN_OR_RETURN(bpe->fuse_unk_, reader.OptionalBool(model, "fuse_unk", "model", false));
  RUBATO_ASSIGN_OR_RETURN(bpe->byte_fallback_,
                          reader.OptionalBool(model, "byte_fallback", "model", false));
  RUBATO_ASSIGN_OR_RETURN(bpe->ignore_merges_,
                          reader.OptionalBool(model, "ignore_merges", "model", false));
  RUBATO_ASSIGN_OR_RETURN(bpe->continuing_subword_prefix_,
                          reader.OptionalString(model, "continuing_subword_prefix", "model", ""));
  RUBATO_ASSIGN_OR_RETURN(bpe->end_of_word_suffix_,
                          reader.OptionalString(model, "end_of_word_suffix", "model", ""));

  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* vocab, reader.Field(model, "vocab", "model"));
  RUBATO_RETURN_IF_ERROR(bpe->LoadVocab(*vocab, reader));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* merges, reader.Field(model, "merges", "model"));
  RUBATO_RETURN_IF_ERROR(bpe->LoadMerges(*merges, reader));

  RUBATO_ASSIGN_OR_RETURN(std::string unk_token,
                          reader.OptionalString(model, "unk_token", "model", ""));
  if (!unk_token.empty()) {
    const int unk_id = bpe->FindId(unk_token);
    if (unk_id < 0) {
      return reader.Error(StatusCode::kDataLoss, "model.unk_token",
                          fmt::format("unk_token '{}' is not in model.vocab", unk_token));
    }
    bpe->unk_id_ = unk_id;
  }
  return bpe;
}

std::optional<int> BpeModel::TokenToId(std::string_view token) const {
  const int id = FindId(token);
  if (id < 0) return std::nullopt;
  return id;
}

const std::string* BpeModel::IdToToken(int id) const {
  if (id < 0 || id >= id_limit() || !id_present_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::MergeWord(std::string_view word, std::vector<int>* ids) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add_symbol = [&symbols](int id) {
    const int index = static_cast<int>(symbols.size());
    if (index > 0) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, true});
  };

  // Characters -> symbols (HF merge_word), with a pending unknown run for fuse_unk.
  int pending_unk = -1;  // unk id waiting to be added (fuse_unk extends it), -1 when none
  std::string piece;
  for (size_t pos = 0; pos < word.size();) {
    const size_t length =
        std::min(Utf8SequenceLength(static_cast<uint8_t>(word[pos])), word.size() - pos);
    const bool is_first = pos == 0;
    const bool is_last = pos + length == word.size();
    piece.clear();
    if (!is_first) piece.append(continuing_subword_prefix_);
    piece.append(word.substr(pos, length));
    if (is_last) piece.append(end_of_word_suffix_);
    pos += length;

    if (const int id = FindId(piece); id >= 0) {
      if (pending_unk >= 0) {
        add_symbol(pending_unk);
        pending_unk = -1;
      }
      add_symbol(id);
      continue;
    }
    if (byte_fallback_) {
      std::vector<int> byte_ids;
      for (const char c : piece) {
        const int id = FindId(fmt::format("<0x{:02X}>", static_cast<uint8_t>(c)));
        if (id < 0) break;
        byte_ids.push_back(id);
      }
      if (byte_ids.size() == piece.size()) {
        for (const int id : byte_ids) add_symbol(id);
        continue;
      }
    }
    if (unk_id_.has_value()) {
      if (pending_unk >= 0 && !fuse_unk_) add_symbol(pending_unk);
      pending_unk = *unk_id_;
    }
    // Without byte_fallback or unk_token, HF drops the character.
  }
  if (pending_unk >= 0) add_symbol(pending_unk);

  // Merge loop (HF Word::merge_all without dropout).
  std::priority_queue<QueuedMerge, std::vector<QueuedMerge>, MergeOrder> queue;
  auto find_merge = [this](int left, int right) { return merges_.Find(left, right); };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeIndex::Merge* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({static_cast<int>(i), m->rank, m->new_id});
    }
  }
  while (!queue.empty()) {
    const QueuedMerge top = queue.top();
    queue.pop();
    Symbol& current = symbols[top.pos];
    if (!current.alive || current.next == -1) continue;
    const int next_pos = current.next;
    const Symbol right = symbols[next_pos];
    // Skip entries made stale by earlier merges.
    const MergeIndex::Merge* still_valid = find_merge(current.id, right.id);
    if (still_valid == nullptr || still_valid->new_id != top.new_id) continue;

    current.id = top.new_id;
    current.next = right.next;
    symbols[next_pos].alive = false;
    if (right.next != -1) symbols[right.next].prev = top.pos;

    if (current.prev != -1) {
      if (const MergeIndex::Merge* m = find_merge(symbols[current.prev].id, current.id)) {
        queue.push({current.prev, m->rank, m->new_id});
      }
    }
    if (current.next != -1) {
      if (const MergeIndex::Merge* m = find_merge(current.id, symbols[current.next].id)) {
        queue.push({top.pos, m->rank, m->new_id});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.alive) ids->push_back(s.id);
  }
}

void BpeModel::Tokenize(std::string_view word, std::vector<int>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const int id = FindId(word); id >= 0) {
      ids->push_back(id);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    if (const auto it = cache_.find(word); it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids->size();
  MergeWord(word, ids);
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) {
      cache_.emplace(std::string(word), std::vector<int>(ids->begin() + first, ids->end()));
    }
  }
}

}  // namespace rubato
