// A minimal HTTP/1.1 client for integration tests (http_test_client.h).
#include "tests/http_test_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>

namespace rubato::testing {

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval timeout{20, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

std::string ReadToEof(int fd) {
  std::string data;
  char buffer[65536];
  while (true) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;  // EOF, error or the 20 s timeout
    data.append(buffer, static_cast<size_t>(n));
  }
  return data;
}

HttpResponse ParseResponse(const std::string& all) {
  HttpResponse response;
  // Interim 1xx responses (100 Continue) come before the final one; a client skips them.
  size_t start = 0;
  while (all.compare(start, 10, "HTTP/1.1 1") == 0 && all.find("\r\n\r\n", start) != all.npos) {
    start = all.find("\r\n\r\n", start) + 4;
  }
  const std::string raw = all.substr(start);
  const size_t head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || head_end == std::string::npos) return response;
  response.status = std::atoi(raw.c_str() + 9);
  size_t line = raw.find("\r\n") + 2;
  while (line < head_end) {
    const size_t end = raw.find("\r\n", line);
    const std::string header = raw.substr(line, end - line);
    const size_t colon = header.find(':');
    std::string name = header.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    response.headers[name] = header.substr(header.find_first_not_of(' ', colon + 1));
    line = end + 2;
  }
  std::string body = raw.substr(head_end + 4);
  if (response.headers["transfer-encoding"] == "chunked") {
    std::string joined;
    size_t at = 0;
    while (at < body.size()) {
      const size_t size_end = body.find("\r\n", at);
      if (size_end == std::string::npos) break;
      const size_t size = std::stoul(body.substr(at, size_end - at), nullptr, 16);
      if (size == 0) break;
      joined += body.substr(size_end + 2, size);
      at = size_end + 2 + size + 2;
    }
    body = joined;
  }
  response.body = body;
  return response;
}

HttpResponse Request(int port, const std::string& method, const std::string& path,
                     const std::string& body, const std::string& headers) {
  const int fd = Connect(port);
  if (fd < 0) return {};
  SendAll(fd, method + " " + path +
                  " HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  "application/json\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\n" + headers + "Connection: close\r\n\r\n" +
                  body);
  const std::string raw = ReadToEof(fd);
  ::close(fd);
  return ParseResponse(raw);
}

}  // namespace rubato::testing
