// Incremental detokenization for printing generated text as it is produced.
//
// Byte-level BPE tokens can end in the middle of a UTF-8 character (an emoji is often split over
// two or three tokens). StreamDecoder takes ids one at a time and returns only text that is
// complete, holding back an unfinished UTF-8 sequence until the next ids finish it; Flush()
// returns what is left (an unfinishable tail becomes U+FFFD). The concatenation of everything
// returned equals Tokenizer::Decode of all the ids with the same skip_special_tokens.
#pragma once

#include <string>

#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/utf8_text.h"

namespace rubato {

class StreamDecoder {
 public:
  // `tokenizer` must outlive the decoder.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false)
      : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

  // The text completed by `id` (often empty while a character is unfinished). Unknown ids add
  // nothing, as in Decode.
  std::string Push(int id);
  // Push that appends the text to `out` instead (no string of its own per token).
  void PushTo(int id, std::string* out);
  // The rest of the text; the decoder is then empty and can be reused.
  std::string Flush();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  Utf8LossyStream utf8_;
  std::string bytes_;  // the pushed token's bytes; reused
};

}  // namespace rubato
