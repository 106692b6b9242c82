// StreamDecoder: token bytes through an incremental lossy UTF-8 decoder.
#include "common/tokenizer/stream_decoder.h"

namespace rubato {

std::string StreamDecoder::Push(int id) {
  std::string bytes;
  tokenizer_->AppendTokenBytes(id, skip_special_tokens_, &bytes);
  std::string text;
  utf8_.Push(bytes, &text);
  return text;
}

std::string StreamDecoder::Flush() {
  std::string text;
  utf8_.Finish(&text);
  return text;
}

}  // namespace rubato
