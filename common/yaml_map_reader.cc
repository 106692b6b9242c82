// Validated YAML map reads with key-path error messages (see yaml_map_reader.h).
//
// Scalars are converted here rather than with yaml-cpp's as<T>(), which throws and accepts
// more spellings than a config should (hex, yes/no, quoted numbers).
#include "common/yaml_map_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "common/json_limits.h"

namespace rubato {
namespace {

// Tags yaml-cpp gives scalars: "?" plain, "!" quoted, or an explicit tag such as "!!int".
constexpr std::string_view kPlainTag = "?";
constexpr std::string_view kQuotedTag = "!";

int LineOf(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  return mark.is_null() ? 0 : mark.line + 1;
}

// Edit distance, for "did you mean" suggestions on misspelled keys.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

std::string Join(const std::vector<std::string_view>& names) {
  std::string text;
  for (std::string_view name : names) text += (text.empty() ? "" : ", ") + std::string(name);
  return text;
}

}  // namespace

std::string DescribeYamlValue(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return "'" + Excerpt(node.Scalar(), 200) + "'";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      break;
  }
  return "null";
}

bool DoubleRange::Contains(double value) const {
  const bool above_min = min_inclusive ? value >= min : value > min;
  const bool below_max = max_inclusive ? value <= max : value < max;
  return above_min && below_max;  // both false for NaN
}

std::string DoubleRange::ToString() const {
  return fmt::format("{}{}, {}{}", min_inclusive ? '[' : '(', min, max, max_inclusive ? ']' : ')');
}

Result<YamlMapReader> YamlMapReader::Open(const YAML::Node& map, std::string key_path,
                                          std::string source) {
  YamlMapReader reader(std::move(key_path), std::move(source));
  if (!map.IsDefined() || map.IsNull()) return reader;
  if (!map.IsMap()) {
    const std::string where =
        reader.source_ + ": " + (reader.key_path_.empty() ? "the document" : reader.key_path_);
    const int line = LineOf(map);
    return InvalidArgumentError(where + ": expected a map of settings, got " +
                                DescribeYamlValue(map) +
                                (line > 0 ? " (line " + std::to_string(line) + ")" : ""));
  }
  for (auto it = map.begin(); it != map.end(); ++it) {
    // Copies, not references: `it->` returns a temporary that owns the pair of handles.
    const YAML::Node key = it->first;
    const YAML::Node value = it->second;
    // Keys of maps built in code (PolicySection::params) carry no position; their values do.
    const int line = LineOf(key) > 0 ? LineOf(key) : LineOf(value);
    if (!key.IsScalar()) {
      return reader.ErrorAtLine(DescribeYamlValue(key), "keys must be plain names", line);
    }
    const auto [seen, inserted] = reader.index_.emplace(key.Scalar(), reader.entries_.size());
    if (!inserted) {
      return reader.ErrorAtLine(key.Scalar(),
                                "duplicate key (first given on line " +
                                    std::to_string(reader.entries_[seen->second].line) + ")",
                                line);
    }
    reader.entries_.push_back({key.Scalar(), value, line});
  }
  return reader;
}

const YamlMapReader::Entry* YamlMapReader::Lookup(std::string_view key) {
  std::string name(key);
  if (read_set_.insert(name).second) read_.push_back(name);
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

bool YamlMapReader::Has(std::string_view key) const { return index_.count(std::string(key)) > 0; }

std::string YamlMapReader::KeyPath(std::string_view key) const {
  return key_path_.empty() ? std::string(key) : key_path_ + "." + std::string(key);
}

Status YamlMapReader::ErrorAtLine(std::string_view key, std::string_view message, int line) const {
  std::string text = source_ + ": " + KeyPath(key) + ": " + std::string(message);
  if (line > 0) text += " (line " + std::to_string(line) + ")";
  return InvalidArgumentError(std::move(text));
}

Status YamlMapReader::Error(std::string_view key, std::string_view message) const {
  int line = 0;
  for (const Entry& entry : entries_) {
    if (entry.key == key) line = entry.line;
  }
  return ErrorAtLine(key, message, line);
}

Status YamlMapReader::ReadPlainScalar(std::string_view key, const char* expected, std::string* text,
                                      bool* present) {
  const Entry* entry = Lookup(key);
  *present = entry != nullptr;
  if (entry == nullptr) return Status::Ok();
  const YAML::Node& node = entry->value;
  if (!node.IsScalar()) {
    return Error(key, std::string("expected ") + expected + ", got " + DescribeYamlValue(node));
  }
  if (node.Tag() == kQuotedTag) {
    return Error(key, std::string("expected ") + expected + ", got the quoted string '" +
                          Excerpt(node.Scalar(), 200) + "'");
  }
  *text = node.Scalar();
  return Status::Ok();
}

Status YamlMapReader::ReadInt64(std::string_view key, int64_t min, int64_t max, int64_t* value) {
  std::string text;
  bool present = false;
  RUBATO_RETURN_IF_ERROR(ReadPlainScalar(key, "an integer", &text, &present));
  if (!present) return Status::Ok();
  const std::string range =
      max == std::numeric_limits<int64_t>::max()
          ? "must be >= " + std::to_string(min)
          : "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  const char* begin = text.data() + (!text.empty() && text[0] == '+' ? 1 : 0);
  const char* end = text.data() + text.size();
  int64_t parsed = 0;
  const auto [stop, error] = std::from_chars(begin, end, parsed);
  if (error == std::errc::result_out_of_range)
    return Error(key, range + ", got " + Excerpt(text, 200));
  if (error != std::errc() || stop != end || begin == end) {
    return Error(key, "expected an integer, got '" + Excerpt(text, 200) + "'");
  }
  if (parsed < min || parsed > max) return Error(key, range + ", got " + Excerpt(text, 200));
  *value = parsed;
  return Status::Ok();
}

Status YamlMapReader::ReadDouble(std::string_view key, const DoubleRange& range, double* value) {
  std::string text;
  bool present = false;
  RUBATO_RETURN_IF_ERROR(ReadPlainScalar(key, "a number", &text, &present));
  if (!present) return Status::Ok();
  const char* begin = text.data() + (!text.empty() && text[0] == '+' ? 1 : 0);
  const char* end = text.data() + text.size();
  double parsed = 0;
  const auto [stop, error] = std::from_chars(begin, end, parsed);
  // from_chars also reads "inf" and "nan"; a config value must be a finite number.
  if (error != std::errc() || stop != end || begin == end || !std::isfinite(parsed)) {
    return Error(key, "expected a number, got '" + Excerpt(text, 200) + "'");
  }
  if (!range.Contains(parsed)) {
    return Error(key, "must be in " + range.ToString() + ", got " + Excerpt(text, 200));
  }
  *value = parsed;
  return Status::Ok();
}

Status YamlMapReader::ReadBool(std::string_view key, bool* value) {
  std::string text;
  bool present = false;
  RUBATO_RETURN_IF_ERROR(ReadPlainScalar(key, "true or false", &text, &present));
  if (!present) return Status::Ok();
  if (text == "true" || text == "True" || text == "TRUE") {
    *value = true;
  } else if (text == "false" || text == "False" || text == "FALSE") {
    *value = false;
  } else {
    return Error(key, "expected true or false, got '" + Excerpt(text, 200) + "'");
  }
  return Status::Ok();
}

Status YamlMapReader::ReadString(std::string_view key, std::string* value) {
  const Entry* entry = Lookup(key);
  if (entry == nullptr) return Status::Ok();
  if (!entry->value.IsScalar()) {
    return Error(key, "expected a string, got " + DescribeYamlValue(entry->value));
  }
  *value = entry->value.Scalar();
  return Status::Ok();
}

Status YamlMapReader::ReadNonEmptyString(std::string_view key, std::string* value) {
  std::string text = *value;
  RUBATO_RETURN_IF_ERROR(ReadString(key, &text));
  if (text.empty()) return Error(key, "must not be empty");
  *value = std::move(text);
  return Status::Ok();
}

Status YamlMapReader::ReadStringList(std::string_view key, std::vector<std::string>* values) {
  const Entry* entry = Lookup(key);
  if (entry == nullptr) return Status::Ok();
  if (!entry->value.IsSequence()) {
    return Error(key, "expected a list of strings, got " + DescribeYamlValue(entry->value));
  }
  std::vector<std::string> items;
  for (size_t i = 0; i < entry->value.size(); ++i) {
    const YAML::Node item = entry->value[i];
    if (!item.IsScalar()) {
      return ErrorAtLine(std::string(key) + "[" + std::to_string(i) + "]",
                         "expected a string, got " + DescribeYamlValue(item), LineOf(item));
    }
    items.push_back(item.Scalar());
  }
  *values = std::move(items);
  return Status::Ok();
}

Status YamlMapReader::ReadEnumName(std::string_view key, std::string* name, bool* present) {
  const Entry* entry = Lookup(key);
  *present = entry != nullptr;
  if (entry == nullptr) return Status::Ok();
  if (!entry->value.IsScalar()) {
    return Error(key, "expected a name, got " + DescribeYamlValue(entry->value));
  }
  *name = entry->value.Scalar();
  return Status::Ok();
}

Status YamlMapReader::ChoiceError(std::string_view key, const std::vector<std::string_view>& names,
                                  const std::string& got) const {
  return Error(key, "must be one of " + Join(names) + "; got '" + Excerpt(got, 200) + "'");
}

Result<YamlMapReader> YamlMapReader::ReadMap(std::string_view key) {
  const Entry* entry = Lookup(key);
  return Open(entry == nullptr ? YAML::Node() : entry->value, KeyPath(key), source_);
}

Result<std::vector<YamlMapReader>> YamlMapReader::ReadMapList(std::string_view key) {
  const Entry* entry = Lookup(key);
  std::vector<YamlMapReader> maps;
  if (entry == nullptr) return maps;
  if (!entry->value.IsSequence()) {
    return Error(key, "expected a list, got " + DescribeYamlValue(entry->value));
  }
  for (size_t i = 0; i < entry->value.size(); ++i) {
    const YAML::Node item = entry->value[i];
    const std::string item_path = KeyPath(key) + "[" + std::to_string(i) + "]";
    if (!item.IsMap()) {
      const int line = LineOf(item);
      return InvalidArgumentError(source_ + ": " + item_path + ": expected a map, got " +
                                  DescribeYamlValue(item) +
                                  (line > 0 ? " (line " + std::to_string(line) + ")" : ""));
    }
    RUBATO_ASSIGN_OR_RETURN(YamlMapReader reader, Open(item, item_path, source_));
    maps.push_back(std::move(reader));
  }
  return maps;
}

YAML::Node YamlMapReader::TakeRemaining() {
  YAML::Node remaining(YAML::NodeType::Map);
  for (const Entry& entry : entries_) {
    if (!read_set_.insert(entry.key).second) continue;
    // Keys are unique (Open refused duplicates): append without yaml-cpp's linear key search.
    remaining.force_insert(entry.key, entry.value);
    read_.push_back(entry.key);
  }
  return remaining;
}

Status YamlMapReader::Finish() const {
  for (const Entry& entry : entries_) {
    if (read_set_.count(entry.key) > 0) continue;
    const std::string* closest = nullptr;
    size_t closest_distance = 0;
    for (const std::string& known : read_) {
      const size_t distance = EditDistance(entry.key, known);
      if (closest == nullptr || distance < closest_distance) {
        closest = &known;
        closest_distance = distance;
      }
    }
    std::string message = "unknown key";
    if (closest != nullptr && closest_distance <= std::max<size_t>(2, closest->size() / 4)) {
      message += "; did you mean '" + *closest + "'?";
    } else if (!read_.empty()) {
      message += "; expected one of " + Join({read_.begin(), read_.end()});
    }
    return ErrorAtLine(entry.key, message, entry.line);
  }
  return Status::Ok();
}

}  // namespace rubato
