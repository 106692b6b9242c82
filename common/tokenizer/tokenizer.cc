// Tokenizer: loading tokenizer.json / tokenizer_config.json, Encode and Decode.
#include "common/tokenizer/tokenizer.h"

#include <fmt/format.h>

#include "common/logging.h"
#include "common/text_file.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/utf8_text.h"

namespace rubato {

namespace {

std::string FileLabel(const std::string& source, std::string_view file) {
  if (source.empty()) return std::string(file);
  return (std::filesystem::path(source) / file).string();
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::LoadFromDirectory(const std::filesystem::path& dir) {
  Result<std::string> tokenizer_json = ReadTextFile(dir / "tokenizer.json", kMaxTokenizerJsonBytes);
  if (!tokenizer_json.ok()) {
    if (tokenizer_json.status().code() == StatusCode::kNotFound) {
      return NotFoundError(
          fmt::format("{}: not found; a model directory needs the Hugging Face tokenizer.json",
                      DisplayPath(dir / "tokenizer.json")));
    }
    return tokenizer_json.status();
  }
  std::string config_json;
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  Result<std::string> config = ReadTextFile(config_path, kMaxTokenizerConfigBytes);
  if (config.ok()) {
    if (config->empty()) {
      return DataLossError(
          fmt::format("{}: the file is empty (expected a JSON object)", DisplayPath(config_path)));
    }
    config_json = std::move(config).value();
  } else if (config.status().code() != StatusCode::kNotFound) {
    return config.status();
  }
  return LoadFromJson(*tokenizer_json, config_json, dir.string());
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::LoadFromJson(std::string_view tokenizer_json,
                                                           std::string_view tokenizer_config_json,
                                                           const std::string& source) {
  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer());
  RUBATO_RETURN_IF_ERROR(tokenizer->Build(tokenizer_json, tokenizer_config_json, source));
  return tokenizer;
}

Status Tokenizer::CheckDecoder(const nlohmann::json* decoder, const JsonReader& reader) const {
  if (decoder == nullptr) {
    return reader.Error(StatusCode::kUnsupported, "decoder",
                        "the decoder is null; rubato needs a ByteLevel decoder to turn ids "
                        "back into text");
  }
  std::vector<std::pair<const nlohmann::json*, std::string>> pending{{decoder, "decoder"}};
  while (!pending.empty()) {
    auto [spec, path] = pending.back();
    pending.pop_back();
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* type_field, reader.Field(*spec, "type", path));
    RUBATO_ASSIGN_OR_RETURN(std::string type,
                            reader.String(*type_field, JsonPathJoin(path, "type")));
    if (type == "ByteLevel") continue;
    if (type == "Sequence") {
      const std::string list_path = JsonPathJoin(path, "decoders");
      RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* list, reader.Field(*spec, "decoders", path));
      RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*list, list_path));
      for (size_t i = 0; i < list->size(); ++i) {
        pending.emplace_back(&(*list)[i], JsonPathIndex(list_path, i));
      }
      continue;
    }
    return reader.Error(StatusCode::kUnsupported, path,
                        fmt::format("decoder type '{}' is not supported (rubato supports "
                                    "ByteLevel and a Sequence of ByteLevel)",
                                    type));
  }
  return Status::Ok();
}

Status Tokenizer::Build(std::string_view tokenizer_json, std::string_view tokenizer_config_json,
                        const std::string& source) {
  const JsonReader reader(FileLabel(source, "tokenizer.json"));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json json, reader.Parse(tokenizer_json));
  RUBATO_RETURN_IF_ERROR(reader.ExpectObject(json, ""));

  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* model, reader.Field(json, "model", ""));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* model_type, reader.Field(*model, "type", "model"));
  RUBATO_ASSIGN_OR_RETURN(std::string type, reader.String(*model_type, "model.type"));
  if (type != "BPE") {
    return reader.Error(
        StatusCode::kUnsupported, "model.type",
        fmt::format("model type '{}' is not supported (rubato supports BPE)", type));
  }
  RUBATO_ASSIGN_OR_RETURN(model_, BpeModel::FromJson(*model, reader));
  RUBATO_ASSIGN_OR_RETURN(
      normalizer_,
      Normalizer::FromJson(reader.OptionalField(json, "normalizer"), reader, "normalizer"));
  RUBATO_ASSIGN_OR_RETURN(
      pre_tokenizer_,
      PreTokenizer::FromJson(reader.OptionalField(json, "pre_tokenizer"), reader, "pre_tokenizer"));
  RUBATO_ASSIGN_OR_RETURN(
      added_vocabulary_,
      AddedVocabulary::FromJson(reader.OptionalField(json, "added_tokens"), reader, normalizer_));
  RUBATO_ASSIGN_OR_RETURN(
      post_processor_, PostProcessor::FromJson(reader.OptionalField(json, "post_processor"), reader,
                                               "post_processor"));
  RUBATO_RETURN_IF_ERROR(CheckDecoder(reader.OptionalField(json, "decoder"), reader));

  vocab_size_ = model_->id_limit();
  const size_t id_bound = vocab_size_ + added_vocabulary_.tokens().size() + BpeModel::kMaxIdGap;
  for (const AddedToken& token : added_vocabulary_.tokens()) {
    if (static_cast<size_t>(token.id) >= id_bound) {
      return reader.Error(StatusCode::kDataLoss, "added_tokens",
                          fmt::format("token '{}' has id {}, far beyond the {} ids of the vocab",
                                      token.content, token.id, model_->id_limit()));
    }
    vocab_size_ = std::max(vocab_size_, token.id + 1);
  }
  BuildDecodeTable();

  const std::string config_file = FileLabel(source, "tokenizer_config.json");
  RUBATO_ASSIGN_OR_RETURN(
      TokenizerConfig config,
      TokenizerConfig::FromJson(tokenizer_config_json, JsonReader(config_file)));
  auto resolve = [&](const std::optional<std::string>& token, std::string_view field,
                     std::optional<int>* id) {
    if (!token.has_value()) return;
    *id = TokenToId(*token);
    if (!id->has_value()) {
      RUBATO_LOG_WARN("tokenizer", "{}: {} '{}' is not a token of the vocabulary; ignored",
                      config_file, field, *token);
    }
  };
  resolve(config.bos_token, "bos_token", &bos_token_id_);
  resolve(config.eos_token, "eos_token", &eos_token_id_);
  chat_template_ = ChatTemplate(config, config_file);
  return Status::Ok();
}

void Tokenizer::BuildDecodeTable() {
  decoded_bytes_.assign(static_cast<size_t>(vocab_size_), std::string());
  id_kinds_.assign(static_cast<size_t>(vocab_size_), IdKind::kUnknown);
  // HF ByteLevel decoder: a token whose characters are all byte-level code points stands for
  // those bytes, any other token for its own UTF-8.
  auto decode_token = [](const std::string& token, std::string* bytes) {
    if (!AppendBytesFromByteLevel(token, bytes)) bytes->assign(token);
  };
  for (int id = 0; id < model_->id_limit(); ++id) {
    const std::string* token = model_->IdToToken(id);
    if (token == nullptr) continue;
    decode_token(*token, &decoded_bytes_[id]);
    id_kinds_[id] = IdKind::kVocab;
  }
  for (const AddedToken& token : added_vocabulary_.tokens()) {
    decoded_bytes_[token.id].clear();
    decode_token(token.content, &decoded_bytes_[token.id]);
    id_kinds_[token.id] = token.special ? IdKind::kSpecial : IdKind::kAdded;
  }
}

std::optional<int> Tokenizer::TokenToId(std::string_view token) const {
  if (const std::optional<int> id = added_vocabulary_.IdOf(token)) return id;
  return model_->TokenToId(token);
}

std::string Tokenizer::IdToToken(int id) const {
  if (id < 0 || id >= vocab_size_) return std::string();
  if (const AddedToken* added = added_vocabulary_.FindById(id)) return added->content;
  const std::string* token = model_->IdToToken(id);
  return token == nullptr ? std::string() : *token;
}

bool Tokenizer::IsSpecialToken(int id) const {
  return id >= 0 && id < vocab_size_ && id_kinds_[id] == IdKind::kSpecial;
}

void Tokenizer::EncodePlainText(std::string_view text, std::vector<int>* ids) const {
  std::vector<std::string> words;
  auto encode_piece = [&](std::string_view piece) {
    words.clear();
    pre_tokenizer_.Split(piece, &words);
    for (const std::string& word : words) model_->Tokenize(word, ids);
  };
  if (normalizer_.empty() && !added_vocabulary_.has_normalized_tokens()) {
    encode_piece(text);
    return;
  }
  const std::string normalized = normalizer_.Apply(text);
  if (!added_vocabulary_.has_normalized_tokens()) {
    encode_piece(normalized);
    return;
  }
  std::vector<AddedVocabulary::Segment> segments;
  added_vocabulary_.SplitNormalized(normalized, &segments);
  for (const AddedVocabulary::Segment& segment : segments) {
    if (segment.token_id >= 0) {
      ids->push_back(segment.token_id);
    } else {
      encode_piece(std::string_view(normalized).substr(segment.begin, segment.end - segment.begin));
    }
  }
}

std::vector<int> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::string repaired;
  if (!IsValidUtf8(text)) {
    repaired = Utf8Lossy(text);
    text = repaired;
  }
  std::vector<int> ids;
  std::vector<AddedVocabulary::Segment> segments;
  added_vocabulary_.SplitRaw(text, &segments);
  for (const AddedVocabulary::Segment& segment : segments) {
    if (segment.token_id >= 0) {
      ids.push_back(segment.token_id);
    } else {
      EncodePlainText(text.substr(segment.begin, segment.end - segment.begin), &ids);
    }
  }
  return post_processor_.Apply(std::move(ids), add_special_tokens);
}

void Tokenizer::AppendTokenBytes(int id, bool skip_special_tokens, std::string* bytes) const {
  if (id < 0 || id >= vocab_size_) return;
  const IdKind kind = id_kinds_[id];
  if (kind == IdKind::kUnknown || (skip_special_tokens && kind == IdKind::kSpecial)) return;
  bytes->append(decoded_bytes_[id]);
}

std::string Tokenizer::Decode(std::span<const int> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int id : ids) AppendTokenBytes(id, skip_special_tokens, &bytes);
  return Utf8Lossy(bytes);
}

}  // namespace rubato
