// Validated reads from one map of a YAML config file (a section, a list entry or a policy's
// parameters), every error naming the file, the full key path and the line. Open the map, Read*
// each known key (absent keys keep the caller's default), then Finish(), which reports any key
// never asked for. No method throws. Examples: docs/common.md "Validated config reads".
#pragma once

#include <yaml-cpp/yaml.h>

#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/status.h"

namespace rubato {

// A closed, open or half-open interval of doubles, e.g. (0, 86400].
struct DoubleRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_inclusive = true;
  bool max_inclusive = true;

  bool Contains(double value) const;  // false for NaN
  std::string ToString() const;       // "(0, 86400]"
};

class YamlMapReader {
 public:
  // `map` must be a YAML map; null or undefined reads as an empty map. `key_path` names it
  // ("engine", "topology.ranks[1]", "" for the document root); `source` is the file name.
  // Duplicate keys and non-scalar keys are errors.
  static Result<YamlMapReader> Open(const YAML::Node& map, std::string key_path,
                                    std::string source);

  // Each Read* leaves *value unchanged when `key` is absent and reports a value of the wrong
  // type or outside its range. An explicit null (`key:` with nothing after it) is a wrong type.
  Status ReadInt64(std::string_view key, int64_t min, int64_t max, int64_t* value);
  // The same into a narrower integer; [min, max] is clipped to what `Int` can hold.
  template <std::integral Int>
  Status ReadInt(std::string_view key, int64_t min, int64_t max, Int* value) {
    using Limits = std::numeric_limits<Int>;
    if (std::cmp_less(min, Limits::min())) min = static_cast<int64_t>(Limits::min());
    if (std::cmp_greater(max, Limits::max())) max = static_cast<int64_t>(Limits::max());
    int64_t wide = static_cast<int64_t>(*value);
    RUBATO_RETURN_IF_ERROR(ReadInt64(key, min, max, &wide));
    *value = static_cast<Int>(wide);
    return Status::Ok();
  }
  Status ReadDouble(std::string_view key, const DoubleRange& range, double* value);
  Status ReadBool(std::string_view key, bool* value);           // true/false (YAML 1.2 spellings)
  Status ReadString(std::string_view key, std::string* value);  // any scalar
  Status ReadNonEmptyString(std::string_view key, std::string* value);
  Status ReadStringList(std::string_view key, std::vector<std::string>* values);

  // A scalar that must be one of `choices` (name, value), e.g. a std::array of
  // {"cpu", Backend::kCpu}, {"cuda", Backend::kCuda}.
  template <typename Enum>
  Status ReadEnum(std::string_view key,
                  std::type_identity_t<std::span<const std::pair<std::string_view, Enum>>> choices,
                  Enum* value) {
    std::string name;
    bool present = false;
    RUBATO_RETURN_IF_ERROR(ReadEnumName(key, &name, &present));
    if (!present) return Status::Ok();
    std::vector<std::string_view> names;
    for (const auto& [choice, choice_value] : choices) {
      if (choice == name) {
        *value = choice_value;
        return Status::Ok();
      }
      names.push_back(choice);
    }
    return ChoiceError(key, names, name);
  }

  // The map under `key` (absent or null: an empty map), its path extended with `key`.
  Result<YamlMapReader> ReadMap(std::string_view key);
  // The maps of the list under `key` (absent: none), with paths `key[i]`.
  Result<std::vector<YamlMapReader>> ReadMapList(std::string_view key);

  // The keys not read so far, as a new map (values shared with the document); they count as
  // read from now on. For maps whose remaining keys someone else validates later.
  YAML::Node TakeRemaining();

  // The first key that no Read* asked for, as an "unknown key" error with a suggestion.
  Status Finish() const;

  // True when `key` is present (even if null). Does not count as reading it.
  bool Has(std::string_view key) const;
  // "<source>: <path>.<key>: <message> (line N)", InvalidArgument, for checks done by callers.
  Status Error(std::string_view key, std::string_view message) const;
  // "<path>.<key>" (or "<key>" at the root).
  std::string KeyPath(std::string_view key) const;
  const std::string& key_path() const { return key_path_; }
  const std::string& source() const { return source_; }

 private:
  struct Entry {
    std::string key;
    YAML::Node value;
    int line = 0;  // 1-based line of the key; 0 when unknown (nodes built in code)
  };

  YamlMapReader(std::string key_path, std::string source)
      : key_path_(std::move(key_path)), source_(std::move(source)) {}

  // Records `key` as known and returns its entry, or nullptr when absent.
  const Entry* Lookup(std::string_view key);
  // The scalar text of `key` for a number or bool: plain or explicitly tagged, not quoted.
  Status ReadPlainScalar(std::string_view key, const char* expected, std::string* text,
                         bool* present);
  Status ReadEnumName(std::string_view key, std::string* name, bool* present);
  Status ChoiceError(std::string_view key, const std::vector<std::string_view>& names,
                     const std::string& got) const;
  Status ErrorAtLine(std::string_view key, std::string_view message, int line) const;

  std::string key_path_;
  std::string source_;
  // Lookups by key are hashed, so that a map of n keys costs O(n) to open, read and finish
  // (a 20k-key section took seconds with linear searches).
  std::vector<Entry> entries_;                     // in file order
  std::unordered_map<std::string, size_t> index_;  // key -> its entry
  std::vector<std::string> read_;                  // keys asked for, in order: the known keys
  std::unordered_set<std::string> read_set_;       // the same, for lookups
};

// "'abc'", "a list", "a map", "null": what a YAML value is, for "expected X, got Y" messages.
std::string DescribeYamlValue(const YAML::Node& node);

}  // namespace rubato
