// `rubato tokenize`: token ids (or counts) of texts read from stdin, one JSON string per line.
// Tools that size prompts in tokens (bench/accuracy/generate.py) keep one process open and
// talk to it line by line, so the output is flushed after every line.
#pragma once

#include <cstdio>
#include <string>

#include "common/status.h"

namespace rubato {

struct TokenizeArgs {
  std::string model_dir;            // Hugging Face model directory holding tokenizer.json
  bool count_only = false;          // print the number of tokens instead of the ids
  bool add_special_tokens = false;  // run the post-processor (BOS for Llama-3; nothing for Qwen)
};

// Reads `input` until EOF. Each line must be a JSON string ("text with \n escapes"); for each
// one writes a JSON array of token ids, or with count_only the number of ids, then a newline,
// and flushes. A line that is not a JSON string is an error naming its line number.
Status RunTokenize(const TokenizeArgs& args, std::FILE* input, std::FILE* output);

}  // namespace rubato
