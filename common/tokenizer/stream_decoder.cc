// StreamDecoder: token bytes through an incremental lossy UTF-8 decoder.
#include "common/tokenizer/stream_decoder.h"

namespace rubato {

std::string StreamDecoder::Push(int id) {
  std::string text;
  PushTo(id, &text);
  return text;
}

void StreamDecoder::PushTo(int id, std::string* out) {
  bytes_.clear();
  tokenizer_->AppendTokenBytes(id, skip_special_tokens_, &bytes_);
  utf8_.Push(bytes_, out);
}

std::string StreamDecoder::Flush() {
  std::string text;
  utf8_.Finish(&text);
  return text;
}

}  // namespace rubato
