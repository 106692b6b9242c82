// The wire format of the RPC control plane: length-prefixed protobuf frames (magic "RBRP",
// uint32 little-endian length, one rubato.rpc.Envelope) on a TCP stream, shared by rpc_server.h
// and rpc_client.h. FrameDecoder takes the stream in arbitrary pieces, checks magic and length
// before allocating, and stays failed after an error (close the connection).
// Byte layout: docs/transport.md "The RPC wire format".
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/proto/rpc.pb.h"
#include "common/status.h"

namespace rubato::rpc {

// Version of rpc.proto's meaning; Hello refuses a peer with another one.
inline constexpr uint32_t kProtocolVersion = 1;

inline constexpr std::array<char, 4> kFrameMagic = {'R', 'B', 'R', 'P'};
inline constexpr size_t kFrameHeaderBytes = 8;  // magic + uint32 length
// Default upper bound of a payload: control messages are small (a Hello with an NCCL unique id
// or a UCX worker address is a few KB); 16 MiB leaves room without inviting abuse.
inline constexpr uint32_t kDefaultMaxFrameBytes = 16u << 20;

// The whole frame (header + payload) of `envelope`. Fails with kOutOfRange when the payload is
// larger than `max_frame_bytes`.
Result<std::string> EncodeFrame(const Envelope& envelope,
                                uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_frame_bytes = kDefaultMaxFrameBytes)
      : max_frame_bytes_(max_frame_bytes) {}

  // Consumes all of `bytes` and appends every Envelope completed by them to `out` (in stream
  // order). Errors, all kDataLoss except the size limit (kOutOfRange), name what was wrong: bad
  // magic (with the bytes seen), a length above the maximum (both numbers), a payload that is
  // not an Envelope (its length). Envelopes completed before the error are still appended.
  Status Feed(std::string_view bytes, std::vector<Envelope>* out);

  // Bytes of a frame received so far and not yet returned (header and payload).
  size_t buffered_bytes() const { return header_filled_ + payload_.size(); }
  bool failed() const { return !error_.ok(); }

 private:
  Status Fail(Status error);

  uint32_t max_frame_bytes_;
  std::array<char, kFrameHeaderBytes> header_{};  // the current frame's header, as received
  size_t header_filled_ = 0;                      // bytes of header_ received, [0, 8]
  uint32_t payload_length_ = 0;                   // N of the current frame, once the header is in
  std::string payload_;                           // [payload_length_] bytes once filled
  Status error_;                                  // sticky: the first error
};

// Error body <-> Status, keeping code and message. An ok Status becomes an INTERNAL error
// (never sent on purpose); ERROR_CODE_UNSPECIFIED or an unknown number reads back as kInternal.
Error ErrorFromStatus(const Status& status);
Status StatusFromError(const Error& error);

// "hello_request", "stats_response", ..., "empty" for an Envelope without a body: for messages.
std::string_view BodyName(const Envelope& envelope);

}  // namespace rubato::rpc
