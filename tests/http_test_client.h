// A minimal HTTP/1.1 client for integration tests that talk to `rubato serve` or a cache rank's
// metrics endpoint: blocking sockets to 127.0.0.1 with 20 s receive / send timeouts, one request
// per connection (Connection: close), chunked bodies joined.
#pragma once

#include <map>
#include <string>

namespace rubato::testing {

struct HttpResponse {
  int status = 0;                              // 0: no parsable response
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
};

// A connected socket to 127.0.0.1:port, or -1.
int Connect(int port);

// A TCP port on 127.0.0.1 that nothing listened on a moment ago (bound to 0, read, closed);
// 0 if none could be bound.
int FreePort();
// Sends all of `data` (stops early on an error).
void SendAll(int fd, const std::string& data);
// Everything until EOF, an error or the receive timeout.
std::string ReadToEof(int fd);
// The status, headers and (de-chunked) body of a raw HTTP/1.1 response, after any interim 1xx
// responses; status 0 when unparsable.
HttpResponse ParseResponse(const std::string& raw);
// One request with a JSON content type and `body`; status 0 when nothing parsable came back.
// `headers`: extra request header lines, each ending in "\r\n" ("Origin: x\r\n").
HttpResponse Request(int port, const std::string& method, const std::string& path,
                     const std::string& body = "", const std::string& headers = "");

}  // namespace rubato::testing
