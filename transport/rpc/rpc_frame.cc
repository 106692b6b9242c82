// Frame encoder and incremental decoder of the RPC control plane (layout in rpc_frame.h).
#include "transport/rpc/rpc_frame.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace rubato::rpc {
namespace {

// What a frame's payload buffer reserves up front; it grows with the bytes that arrive.
constexpr size_t kInitialPayloadReserve = 64 * 1024;

void PutUint32LittleEndian(uint32_t value, char* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xffu);
}

uint32_t GetUint32LittleEndian(const char* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= uint32_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return value;
}

// "GET " for printable bytes, else hex ("0x00 0xff 0x12 0x34"), for the bad-magic message.
std::string DescribeBytes(const char* bytes, size_t size) {
  const bool printable = std::all_of(bytes, bytes + size, [](char c) {
    return std::isprint(static_cast<unsigned char>(c)) != 0;
  });
  if (printable) return fmt::format("'{}'", std::string_view(bytes, size));
  std::string hex;
  for (size_t i = 0; i < size; ++i) {
    hex += fmt::format("{}0x{:02x}", i == 0 ? "" : " ", static_cast<unsigned char>(bytes[i]));
  }
  return hex;
}

}  // namespace

Result<std::string> EncodeFrame(const Envelope& envelope, uint32_t max_frame_bytes) {
  const size_t payload_bytes = envelope.ByteSizeLong();
  if (payload_bytes > max_frame_bytes) {
    return OutOfRangeError(fmt::format(
        "RPC frame: the {} message is {} bytes, above the maximum frame payload of {} bytes",
        BodyName(envelope), payload_bytes, max_frame_bytes));
  }
  std::string frame(kFrameHeaderBytes + payload_bytes, '\0');
  std::copy(kFrameMagic.begin(), kFrameMagic.end(), frame.begin());
  PutUint32LittleEndian(static_cast<uint32_t>(payload_bytes), frame.data() + 4);
  if (!envelope.SerializeToArray(frame.data() + kFrameHeaderBytes,
                                 static_cast<int>(payload_bytes))) {
    return InternalError(fmt::format("RPC frame: serializing the {} message failed",
                                     BodyName(envelope)));
  }
  return frame;
}

Status FrameDecoder::Fail(Status error) {
  error_ = error;
  payload_.clear();
  payload_.shrink_to_fit();
  return error;
}

Status FrameDecoder::Feed(std::string_view bytes, std::vector<Envelope>* out) {
  if (!error_.ok()) return error_;
  while (!bytes.empty()) {
    if (header_filled_ < kFrameHeaderBytes) {
      const size_t take = std::min(kFrameHeaderBytes - header_filled_, bytes.size());
      std::copy_n(bytes.data(), take, header_.data() + header_filled_);
      header_filled_ += take;
      bytes.remove_prefix(take);
      // Check the magic as soon as its bytes are in: garbage is reported without waiting for more.
      const size_t magic_seen = std::min(header_filled_, kFrameMagic.size());
      if (!std::equal(header_.begin(), header_.begin() + magic_seen, kFrameMagic.begin())) {
        return Fail(DataLossError(fmt::format(
            "RPC frame: bad magic {} (expected 'RBRP'): the peer does not speak the rubato RPC",
            DescribeBytes(header_.data(), magic_seen))));
      }
      if (header_filled_ < kFrameHeaderBytes) continue;
      payload_length_ = GetUint32LittleEndian(header_.data() + 4);
      if (payload_length_ > max_frame_bytes_) {
        return Fail(OutOfRangeError(fmt::format(
            "RPC frame: payload length {} bytes exceeds the maximum frame size of {} bytes",
            payload_length_, max_frame_bytes_)));
      }
      payload_.clear();
      // Memory follows the bytes that arrive, never the length a peer announces: 8 bytes
      // claiming 16 MiB (before any Hello, on every connection) must not reserve 16 MiB.
      payload_.reserve(std::min<size_t>(payload_length_, kInitialPayloadReserve));
    }
    const size_t take = std::min<size_t>(payload_length_ - payload_.size(), bytes.size());
    payload_.append(bytes.data(), take);
    bytes.remove_prefix(take);
    if (payload_.size() < payload_length_) continue;
    Envelope envelope;
    if (!envelope.ParseFromString(payload_)) {
      return Fail(DataLossError(fmt::format(
          "RPC frame: a payload of {} bytes does not parse as a rubato.rpc.Envelope",
          payload_length_)));
    }
    out->push_back(std::move(envelope));
    header_filled_ = 0;
    payload_length_ = 0;
    payload_.clear();
  }
  return Status::Ok();
}

Error ErrorFromStatus(const Status& status) {
  Error error;
  if (status.ok()) {
    error.set_code(INTERNAL);
    error.set_message("an ok status was sent as an error (rubato bug)");
    return error;
  }
  error.set_code(static_cast<ErrorCode>(static_cast<int>(status.code())));
  error.set_message(status.message());
  return error;
}

Status StatusFromError(const Error& error) {
  const int code = static_cast<int>(error.code());
  if (code <= 0 || code > static_cast<int>(StatusCode::kInternal)) {
    return InternalError(fmt::format("{} (the peer sent error code {})", error.message(), code));
  }
  return Status(static_cast<StatusCode>(code), error.message());
}

std::string_view BodyName(const Envelope& envelope) {
  switch (envelope.body_case()) {
    case Envelope::kHelloRequest: return "hello_request";
    case Envelope::kHelloResponse: return "hello_response";
    case Envelope::kOpenSessionRequest: return "open_session_request";
    case Envelope::kOpenSessionResponse: return "open_session_response";
    case Envelope::kCloseSessionRequest: return "close_session_request";
    case Envelope::kCloseSessionResponse: return "close_session_response";
    case Envelope::kStatsRequest: return "stats_request";
    case Envelope::kStatsResponse: return "stats_response";
    case Envelope::kHealthRequest: return "health_request";
    case Envelope::kHealthResponse: return "health_response";
    case Envelope::kShutdownRequest: return "shutdown_request";
    case Envelope::kShutdownResponse: return "shutdown_response";
    case Envelope::kHeartbeat: return "heartbeat";
    case Envelope::kError: return "error";
    case Envelope::BODY_NOT_SET: return "empty";
  }
  return "unknown";
}

}  // namespace rubato::rpc
