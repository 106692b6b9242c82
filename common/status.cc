// Status code names (status.h), for logs and test messages; user-facing messages never show them.
#include "common/status.h"

namespace rubato {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kOutOfRange:
      return "out of range";
    case StatusCode::kDataLoss:
      return "data loss";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kFailedPrecondition:
      return "failed precondition";
    case StatusCode::kResourceExhausted:
      return "resource exhausted";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kDeadlineExceeded:
      return "deadline exceeded";
    case StatusCode::kIoError:
      return "I/O error";
    case StatusCode::kInternal:
      return "internal";
  }
  return "unknown";
}

}  // namespace rubato
