// Nesting-depth scans and message excerpts (see json_limits.h).
#include "common/json_limits.h"

namespace rubato {

namespace {

Status TooDeep(std::string_view what, std::string_view format, int max_depth, size_t at) {
  return InvalidArgumentError(std::string(what) + ": " + std::string(format) +
                              " nested deeper than " + std::to_string(max_depth) +
                              " levels (at byte " + std::to_string(at) + ")");
}

}  // namespace

Status CheckJsonNesting(std::string_view text, std::string_view what, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return TooDeep(what, "JSON", max_depth, i);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return Status::Ok();
}

Status CheckYamlFlowNesting(std::string_view text, std::string_view what, int max_depth) {
  int depth = 0;
  char quote = 0;          // the open quote, 0 outside quoted scalars
  bool comment = false;    // after '#' to the end of the line
  bool line_start = true;  // only whitespace since the last newline
  char previous = '\n';
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      comment = false;
      line_start = true;
      previous = c;
      continue;
    }
    if (comment) continue;
    if (quote != 0) {
      if (quote == '"' && c == '\\') {
        ++i;
      } else if (c == quote) {
        quote = 0;
      }
      previous = c;
      continue;
    }
    if (c == '#' && (line_start || previous == ' ' || previous == '\t')) {
      comment = true;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return TooDeep(what, "YAML", max_depth, i);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
    if (c != ' ' && c != '\t') line_start = false;
    previous = c;
  }
  return Status::Ok();
}

std::string Excerpt(std::string_view text, size_t max_chars) {
  if (text.size() <= max_chars) return std::string(text);
  return std::string(text.substr(0, max_chars)) + "... (" + std::to_string(text.size()) + " bytes)";
}

}  // namespace rubato
