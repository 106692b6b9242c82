// `rubato tokenize` (see tokenize_command.h): loads the tokenizer once, then encodes one JSON
// string per input line.
#include "inference_rank/cli/tokenize_command.h"

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"

namespace rubato {
namespace {

// One line of `input` without its '\n' (and a '\r' before it). False at EOF with nothing read.
bool ReadLine(std::FILE* input, std::string* line) {
  line->clear();
  int c;
  bool any = false;
  while ((c = std::fgetc(input)) != EOF) {
    any = true;
    if (c == '\n') break;
    line->push_back(static_cast<char>(c));
  }
  if (!line->empty() && line->back() == '\r') line->pop_back();
  return any;
}

Status WriteLine(std::FILE* output, const std::string& text) {
  if (std::fwrite(text.data(), 1, text.size(), output) != text.size() ||
      std::fputc('\n', output) == EOF || std::fflush(output) != 0) {
    return IoError("tokenize: cannot write the output (closed pipe?)");
  }
  return Status::Ok();
}

}  // namespace

Status RunTokenize(const TokenizeArgs& args, std::FILE* input, std::FILE* output) {
  if (!std::filesystem::is_directory(args.model_dir)) {
    return NotFoundError("model directory '" + args.model_dir + "' does not exist");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(args.model_dir));
  std::string line;
  for (int line_number = 1; ReadLine(input, &line); ++line_number) {
    const nlohmann::json text = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!text.is_string()) {
      return InvalidArgumentError("tokenize: stdin line " + std::to_string(line_number) +
                                  " is not a JSON string (write each text as \"...\" with "
                                  "JSON escapes)");
    }
    const std::vector<int> ids =
        tokenizer->Encode(text.get_ref<const std::string&>(), args.add_special_tokens);
    RUBATO_RETURN_IF_ERROR(WriteLine(
        output, args.count_only ? std::to_string(ids.size()) : nlohmann::json(ids).dump()));
  }
  if (std::ferror(input)) return IoError("tokenize: cannot read stdin");
  return Status::Ok();
}

}  // namespace rubato
