// libFuzzer target: a model's tokenizer files through Tokenizer::LoadFromJson. The input is
// tokenizer.json, optionally followed by a NUL byte and tokenizer_config.json (JSON text holds no
// raw NUL). A tokenizer it accepts then encodes a fixed sample and the input's first bytes,
// decodes the ids, names each id and renders a chat through its template, as `rubato serve`
// would. Seeds: corpus/tokenizer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = std::min(input.find('\0'), input.size());
  const std::string_view tokenizer_json = input.substr(0, split);
  const std::string_view config_json =
      split < input.size() ? input.substr(split + 1) : std::string_view();
  const auto tokenizer = rubato::Tokenizer::LoadFromJson(tokenizer_json, config_json, "fuzz");
  if (!tokenizer.ok()) return 0;
  const rubato::Tokenizer& t = **tokenizer;

  std::string text = "Hello, world! café 123 <|endoftext|> \xe4\xbd\xa0\xe5\xa5\xbd\n\t ";
  text.append(input.substr(0, 64));  // may be invalid UTF-8: Encode repairs it
  std::vector<int> ids = t.Encode(text, /*add_special_tokens=*/true);
  ids.push_back(-1);
  ids.push_back(t.vocab_size());
  static_cast<void>(t.Decode(ids, /*skip_special_tokens=*/false));
  static_cast<void>(t.Decode(ids, /*skip_special_tokens=*/true));
  for (const int id : ids) {
    const std::string token = t.IdToToken(id);
    if (!token.empty() && !t.TokenToId(token)) __builtin_trap();  // named but not found back
  }
  const std::vector<rubato::ChatMessage> chat = {
      {"system", "Be brief."}, {"user", text}, {"assistant", "ok"}, {"user", "again"}};
  static_cast<void>(t.ApplyChatTemplate(chat));
  static_cast<void>(t.ApplyChatTemplate(chat, /*add_generation_prompt=*/false,
                                        /*enable_thinking=*/false));
  return 0;
}
