// Policy parameters in the config (policy_params.h): their key rule and their YAML form.
#include "common/policy_params.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "common/yaml_map_reader.h"

namespace rubato {
namespace {

// Policy parameter keys, at any depth, are names: scalars of at most kMaxParamKeyBytes without
// control characters. Anything else is refused here, which also keeps every key short enough
// to be written back as an implicit YAML key (at most 1024 characters once escaped).
constexpr size_t kMaxParamKeyBytes = 128;

bool IsParamKeyName(const YAML::Node& key) {
  if (!key.IsScalar()) return false;
  const std::string& text = key.Scalar();
  if (text.empty() || text.size() > kMaxParamKeyBytes) return false;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) return false;
  }
  return true;
}

// Checks the keys of every map under `node`, `path` its place under the section; `visited`
// holds the collections already checked (aliases share them).
Status CheckParamKeys(const YAML::Node& node, const std::string& path, const std::string& source,
                      const std::string& key_path, std::vector<YAML::Node>* visited) {
  if (!node.IsMap() && !node.IsSequence()) return Status::Ok();
  for (const YAML::Node& seen : *visited) {
    if (seen.is(node)) return Status::Ok();
  }
  visited->push_back(node);
  if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) {
      RUBATO_RETURN_IF_ERROR(
          CheckParamKeys(node[i], path + "[" + std::to_string(i) + "]", source, key_path, visited));
    }
    return Status::Ok();
  }
  for (auto it = node.begin(); it != node.end(); ++it) {
    const YAML::Node key = it->first;
    if (!IsParamKeyName(key)) {
      // Keys of the section's remaining map carry no position; their values do.
      const YAML::Mark mark = key.Mark().is_null() ? it->second.Mark() : key.Mark();
      return InvalidArgumentError(fmt::format(
          "{}: {}{}: keys must be names of 1 to {} characters without control characters, got "
          "{}{}",
          source, key_path, path, kMaxParamKeyBytes, DescribeYamlValue(key),
          mark.is_null() ? "" : fmt::format(" (line {})", mark.line + 1)));
    }
    RUBATO_RETURN_IF_ERROR(
        CheckParamKeys(it->second, path + "." + key.Scalar(), source, key_path, visited));
  }
  return Status::Ok();
}

// Policy parameters keep their YAML form through FormatConfigYaml + ParseConfig: a quoted scalar
// must come back quoted (the typed readers refuse "64" where they want 64) and with its exact
// text. yaml-cpp's emitter drops the quotes of a quoted scalar whenever plain text would do, and
// writes some strings plain that do not read back (a trailing carriage return, for one). So the
// parameters go out through ParamEmitter, which quotes every quoted scalar and every one that
// plain text would change, and keeps tags, styles, anchors and aliases (anchors numbered in
// order of first use, as yaml-cpp numbers them).
// Whether `text` written plain (as yaml-cpp's emitter writes it, inside a block map with an
// entry after it, as the formatted config has it) reads back as `text`: "4\r" alone reads back
// whole, but not when a line follows.
bool PlainReadsBack(const std::string& text) {
  try {
    YAML::Emitter probe;
    probe << YAML::BeginMap << YAML::Key << "k" << YAML::Value << text << YAML::Key << "next"
          << YAML::Value << 0 << YAML::EndMap;
    const YAML::Node again = YAML::Load(probe.c_str());
    return again["k"].IsScalar() && again["k"].Scalar() == text;
  } catch (const YAML::Exception&) {
    return false;
  }
}

class ParamEmitter {
 public:
  // Counts the uses of every node under `root`, so that shared ones get anchors.
  ParamEmitter(YAML::Emitter& out, const YAML::Node& root) : out_(out) { Count(root); }

  // Writes `node`, which must lie under the root.
  void Write(const YAML::Node& node) {
    Seen* seen = Find(node);
    if (seen->anchor > 0) {
      out_ << YAML::Alias(std::to_string(seen->anchor));
      return;
    }
    if (seen->uses > 1) {
      seen->anchor = ++anchors_;
      out_ << YAML::Anchor(std::to_string(seen->anchor));
    }
    WriteContent(node);
  }

 private:
  struct Seen {
    YAML::Node node;
    int uses = 0;
    int anchor = 0;
  };

  Seen* Find(const YAML::Node& node) {
    for (Seen& seen : seen_) {
      if (seen.node.is(node)) return &seen;
    }
    return nullptr;
  }

  void Count(const YAML::Node& node) {
    if (Seen* seen = Find(node)) {
      ++seen->uses;
      return;  // an alias: its children are counted once
    }
    seen_.push_back({node, 1, 0});
    if (node.IsSequence()) {
      for (const YAML::Node& item : node) Count(item);
    } else if (node.IsMap()) {
      for (auto it = node.begin(); it != node.end(); ++it) {
        Count(it->first);
        Count(it->second);
      }
    }
  }

  void WriteContent(const YAML::Node& node) {
    const std::string& tag = node.Tag();
    if (!tag.empty() && tag != "?" && tag != "!") out_ << YAML::VerbatimTag(tag);
    const auto style = node.Style() == YAML::EmitterStyle::Flow ? YAML::Flow : YAML::Block;
    switch (node.Type()) {
      case YAML::NodeType::Scalar:
        if (tag == "!" || !PlainReadsBack(node.Scalar())) out_ << YAML::DoubleQuoted;
        out_ << node.Scalar();
        return;
      case YAML::NodeType::Sequence:
        out_ << style << YAML::BeginSeq;
        for (const YAML::Node& item : node) Write(item);
        out_ << YAML::EndSeq;
        return;
      case YAML::NodeType::Map:
        out_ << style << YAML::BeginMap;
        for (auto it = node.begin(); it != node.end(); ++it) {
          out_ << YAML::Key;
          Write(it->first);
          out_ << YAML::Value;
          Write(it->second);
        }
        out_ << YAML::EndMap;
        return;
      default:
        out_ << YAML::Null;
    }
  }

  YAML::Emitter& out_;
  std::vector<Seen> seen_;
  int anchors_ = 0;
};

}  // namespace

Status CheckPolicyParamKeys(const YAML::Node& params, const std::string& source,
                            const std::string& key_path) {
  std::vector<YAML::Node> visited;
  return CheckParamKeys(params, "", source, key_path, &visited);
}

void WritePolicyParams(YAML::Emitter& out, const YAML::Node& params) {
  ParamEmitter emitter(out, params);
  for (auto it = params.begin(); it != params.end(); ++it) {
    out << YAML::Key;
    emitter.Write(it->first);
    out << YAML::Value;
    emitter.Write(it->second);
  }
}

}  // namespace rubato
