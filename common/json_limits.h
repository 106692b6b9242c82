// Bounds on untrusted JSON and YAML text before a parser sees it: nesting depth (the parsers and
// the values they build recurse per level, so a deep document overflows the stack) and short
// excerpts of input for error messages. docs/security.md "Bounded input".
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"

namespace rubato {

// The deepest nesting of objects and arrays rubato accepts in any JSON document: model configs
// and safetensors headers need 3, tokenizer.json about 10, OpenAI requests about 6.
inline constexpr int kMaxJsonDepth = 64;

// InvalidArgument "<what>: JSON nested deeper than <max_depth> levels (at byte N)" when an
// object or array outside a string opens level max_depth + 1; a linear scan, no allocation.
// Malformed text passes (the parser reports it).
Status CheckJsonNesting(std::string_view text, std::string_view what,
                        int max_depth = kMaxJsonDepth);

// The same for YAML flow collections ([ and { outside quotes and comments).
Status CheckYamlFlowNesting(std::string_view text, std::string_view what,
                            int max_depth = kMaxJsonDepth);

// At most `max_chars` of `text` for an error message, with "... (N bytes)" when cut.
std::string Excerpt(std::string_view text, size_t max_chars = 64);

}  // namespace rubato
