// A reply that a handler of `rubato serve`'s HTTP server (http_server.h) completes later, from
// any thread: whole, or as a stream of body pieces (Server-Sent Events). The connection takes
// what is ready each time it is notified, and cancels the reply when its client goes away.
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace rubato::server {

// Extra response headers, in order: {name, value}.
using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// A reply completed later, from any thread: either whole (Complete) or as a stream of body
// pieces (StartStream, Write..., EndStream). Thread-safe.
class PendingReply {
 public:
  // Headers every form of the reply carries (e.g. CORS), set before the connection takes it.
  void SetHeaders(HttpHeaders headers);
  // The whole reply, with `headers` after SetHeaders'; ignored after StartStream (a stream ends
  // with EndStream).
  void Complete(int status, std::string content_type, std::string body, HttpHeaders headers = {});
  // A 200 reply with this content type whose body follows in pieces.
  void StartStream(std::string content_type);
  void Write(std::string piece);
  // Ends the stream; `close_connection` also closes the connection afterwards (after an error).
  void EndStream(bool close_connection = false);
  // Called at most once, on the I/O thread, when the client went away before the reply ended.
  void SetOnCancel(std::function<void()> on_cancel);

  // The connection's side.
  struct Progress {
    bool complete = false;  // a whole reply: status, content_type, body
    int status = 200;
    std::string content_type;
    std::string body;             // whole reply body, or the stream's new pieces
    HttpHeaders headers = {};     // with the whole reply or the stream's start
    bool stream_started = false;  // StartStream happened (content_type set the first time)
    bool stream_ended = false;
    bool close_connection = false;
  };
  Progress Take();
  // Called after a producer call, unless an earlier call's notification has not been followed by
  // a Take yet (that Take gets this change as well).
  void SetNotify(std::function<void()> notify);
  void Cancel();  // runs on_cancel once

 private:
  void Notify(std::unique_lock<std::mutex>& lock);

  std::mutex mutex_;
  Progress progress_;  // what the connection has not taken yet
  bool content_type_taken_ = false;
  bool finished_ = false;  // Complete or EndStream happened
  bool cancelled_ = false;
  bool notified_ = false;  // notify_ ran and no Take followed yet
  std::function<void()> notify_;
  std::function<void()> on_cancel_;
};

}  // namespace rubato::server
