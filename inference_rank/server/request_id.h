// The x-request-id every reply of `rubato serve` carries: the client's when it sent a valid one,
// else a fresh one. Shared by the OpenAI router and the HTTP layer's own error replies (413,
// 431, malformed requests), so that a refused request can be found in the logs as any other.
// docs/serving.md (x-request-id).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace rubato::server {

// The longest x-request-id echoed; longer ones are refused (a header of kilobytes would be
// copied into every reply and log line).
inline constexpr size_t kMaxRequestIdLength = 128;

// 24 random hex digits: a request id when the client sent none (OpenAI's ids look alike).
std::string NewRequestId();

// Whether the client's x-request-id can be echoed: 1..128 visible ASCII characters.
bool ValidRequestId(std::string_view id);

// The id to echo: `client_id` when valid, else a new one.
std::string EchoedRequestId(std::string_view client_id);

}  // namespace rubato::server
