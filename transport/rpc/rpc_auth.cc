// Token reading and comparison (see rpc_auth.h).
#include "transport/rpc/rpc_auth.h"

#include <cstdlib>
#include <fstream>

#include "common/text_file.h"

namespace rubato::rpc {

namespace {

std::string Trimmed(std::string text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  const size_t last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

}  // namespace

Result<std::string> AuthTokenFromEnvironment() {
  if (const char* token = std::getenv(kTokenEnv); token != nullptr && *token != '\0') {
    if (std::string_view(token).size() > kMaxTokenBytes) {
      return InvalidArgumentError(std::string(kTokenEnv) + " is longer than 4096 bytes");
    }
    return std::string(token);
  }
  const char* file = std::getenv(kTokenFileEnv);
  if (file == nullptr || *file == '\0') return std::string();
  Result<std::string> text = ReadTextFile(file, kMaxTokenBytes);
  if (!text.ok()) return text.status().WithContext(kTokenFileEnv);
  std::string token = Trimmed(std::move(text).value());
  if (token.empty()) {
    return InvalidArgumentError(std::string(kTokenFileEnv) + ": " + DisplayPath(file) +
                                " holds no token");
  }
  return token;
}

bool TokensEqual(std::string_view a, std::string_view b) {
  // Every byte of the longer string is looked at whatever the shorter holds.
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference |= static_cast<unsigned char>(x ^ y);
  }
  return difference == 0;
}

Result<std::string> RandomAuthToken() {
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!urandom.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return IoError("cannot read /dev/urandom for an RPC token");
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char byte : bytes) {
    token += kHex[byte >> 4];
    token += kHex[byte & 15];
  }
  return token;
}

}  // namespace rubato::rpc
