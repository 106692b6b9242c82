// The thread-safe hand-over of a pending reply (see pending_reply.h).
#include "inference_rank/server/pending_reply.h"

namespace rubato::server {

void PendingReply::SetHeaders(HttpHeaders headers) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Before those of a Complete that may have come first (the engine thread races the handler).
  progress_.headers.insert(progress_.headers.begin(), headers.begin(), headers.end());
}

void PendingReply::Complete(int status, std::string content_type, std::string body,
                            HttpHeaders headers) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished_ || progress_.stream_started) return;
  finished_ = true;
  progress_.complete = true;
  progress_.status = status;
  progress_.content_type = std::move(content_type);
  progress_.body = std::move(body);
  for (auto& header : headers) progress_.headers.push_back(std::move(header));
  Notify(lock);
}

void PendingReply::StartStream(std::string content_type) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished_ || progress_.stream_started) return;
  progress_.stream_started = true;
  progress_.content_type = std::move(content_type);
  Notify(lock);
}

void PendingReply::Write(std::string piece) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished_ || !progress_.stream_started || piece.empty()) return;
  progress_.body += piece;
  Notify(lock);
}

void PendingReply::EndStream(bool close_connection) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished_ || !progress_.stream_started) return;
  finished_ = true;
  progress_.stream_ended = true;
  progress_.close_connection = close_connection;
  Notify(lock);
}

void PendingReply::SetOnCancel(std::function<void()> on_cancel) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_cancel_ = std::move(on_cancel);
}

void PendingReply::SetNotify(std::function<void()> notify) {
  std::unique_lock<std::mutex> lock(mutex_);
  notify_ = std::move(notify);
  notified_ = false;
  Notify(lock);  // something may be ready already
}

void PendingReply::Notify(std::unique_lock<std::mutex>& lock) {
  // A notification the connection has not answered with Take yet covers this change too: one
  // wakeup per Take, not per piece.
  if (!notify_ || notified_) return;
  notified_ = true;
  std::function<void()> notify = notify_;
  lock.unlock();
  notify();
}

PendingReply::Progress PendingReply::Take() {
  std::lock_guard<std::mutex> lock(mutex_);
  notified_ = false;
  std::string body = std::move(progress_.body);
  Progress taken = progress_;
  taken.body = std::move(body);
  // What stays: the stream's state flags; the body pieces and the whole reply are handed over.
  progress_.body.clear();
  if (progress_.complete || progress_.stream_started) progress_.headers.clear();  // sent now
  progress_.complete = false;
  if (content_type_taken_) taken.content_type.clear();
  if (progress_.stream_started) content_type_taken_ = true;
  return taken;
}

void PendingReply::Cancel() {
  std::function<void()> on_cancel;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (cancelled_ || finished_) return;
    cancelled_ = true;
    on_cancel = std::move(on_cancel_);
  }
  if (on_cancel) on_cancel();
}

}  // namespace rubato::server
