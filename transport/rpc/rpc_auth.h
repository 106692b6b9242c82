// The cache rank's RPC authentication: a shared token that every Hello must carry when the
// cache rank was given one, read from the environment (RUBATO_CACHE_TOKEN, or the file named by
// RUBATO_CACHE_TOKEN_FILE: a Kubernetes Secret mounted as a file) and compared in constant time.
// docs/security.md "The cache rank's RPC".
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace rubato::rpc {

inline constexpr const char* kTokenEnv = "RUBATO_CACHE_TOKEN";
inline constexpr const char* kTokenFileEnv = "RUBATO_CACHE_TOKEN_FILE";
inline constexpr size_t kMaxTokenBytes = 4096;

// The token from the environment: RUBATO_CACHE_TOKEN when set, else the contents of the file
// RUBATO_CACHE_TOKEN_FILE names (surrounding whitespace trimmed), else "" (no authentication).
// InvalidArgument for a token file that cannot be read, is empty or longer than 4 KiB.
Result<std::string> AuthTokenFromEnvironment();

// a == b, in time that depends on the lengths only (not on where they differ).
bool TokensEqual(std::string_view a, std::string_view b);

// 32 random bytes from /dev/urandom as 64 hex digits: a launcher's token for its own ranks.
Result<std::string> RandomAuthToken();

}  // namespace rubato::rpc
