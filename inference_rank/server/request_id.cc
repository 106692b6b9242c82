// Request ids of `rubato serve` (see request_id.h).
#include "inference_rank/server/request_id.h"

#include <algorithm>
#include <cstdio>
#include <random>

namespace rubato::server {

std::string NewRequestId() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%016llx%08x", static_cast<unsigned long long>(rng()),
                static_cast<unsigned>(rng() & 0xffffffffu));
  return hex;
}

bool ValidRequestId(std::string_view id) {
  if (id.empty() || id.size() > kMaxRequestIdLength) return false;
  return std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

std::string EchoedRequestId(std::string_view client_id) {
  return ValidRequestId(client_id) ? std::string(client_id) : NewRequestId();
}

}  // namespace rubato::server
