// Errors as values: Status and Result<T>, used at every library boundary in rubato.
//
// A Status carries a code and a message a user can act on, e.g.
//   "safetensors: tensor 'model.norm.weight' in model.safetensors ends at byte 9123456 but the
//    file has 9000000 bytes".
// Context is added on the way up with WithContext("loading model /x"), producing
// "loading model /x: safetensors: ...". Exceptions never cross these boundaries.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace rubato {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // the caller's input is wrong (bad flag, bad config value)
  kNotFound,            // a file, tensor or key that must exist does not
  kOutOfRange,          // a value outside its allowed range (prompt longer than context)
  kDataLoss,            // a file is truncated or internally inconsistent
  kUnsupported,         // valid input that rubato does not handle (unknown architecture)
  kFailedPrecondition,  // the system is not in a state that allows the call
  kResourceExhausted,   // out of KV blocks, queue full
  kUnavailable,         // a peer or device is not reachable
  kDeadlineExceeded,    // a deadline passed
  kIoError,             // the OS refused a read/write/mmap
  kInternal,            // a broken invariant inside rubato
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "message" for errors, "ok" otherwise. The code name is not included: messages are written
  // for users and already say what went wrong.
  std::string ToString() const { return ok() ? std::string("ok") : message_; }

  // Prefixes the message with "context: ", keeping the code. No-op on ok.
  Status WithContext(std::string_view context) const {
    if (ok()) return *this;
    return Status(code_, std::string(context) + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgumentError(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status OutOfRangeError(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status UnsupportedError(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status FailedPreconditionError(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status ResourceExhaustedError(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DeadlineExceededError(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Result<T>: either a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : storage_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(storage_).ok()) {
      storage_ = Status(StatusCode::kInternal, "Result constructed from an ok Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(storage_); }
  // The error; Status::Ok() when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(storage_); }

  T& value() & { return std::get<T>(storage_); }
  const T& value() const& { return std::get<T>(storage_); }
  T&& value() && { return std::get<T>(std::move(storage_)); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> storage_;
};

}  // namespace rubato

#define RUBATO_CONCAT_INNER_(a, b) a##b
#define RUBATO_CONCAT_(a, b) RUBATO_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function if it is not ok.
#define RUBATO_RETURN_IF_ERROR(expr)               \
  do {                                             \
    ::rubato::Status rubato_status_ = (expr);      \
    if (!rubato_status_.ok()) return rubato_status_; \
  } while (0)

// `lhs = value of expr`, or returns its Status. lhs may be a declaration: `auto x`.
#define RUBATO_ASSIGN_OR_RETURN(lhs, expr) \
  RUBATO_ASSIGN_OR_RETURN_IMPL_(RUBATO_CONCAT_(rubato_result_, __LINE__), lhs, expr)
#define RUBATO_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
