// libFuzzer target: bytes a peer sends to the RPC control plane through rpc::FrameDecoder (magic,
// length, protobuf Envelope). The first byte sets the size of the pieces the stream arrives in;
// the envelopes and the error must not depend on it (the whole stream is decoded again in one
// piece and compared), and every decoded envelope must encode and decode back to itself.
// Seeds: corpus/rpc_frame.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "transport/rpc/rpc_frame.h"

namespace rpc = rubato::rpc;

namespace {

// The envelope's bytes with map entries sorted: equal for equal messages (plain serialization
// orders a map as its hash table happens to).
std::string Canonical(const rpc::Envelope& envelope) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    envelope.SerializeToCodedStream(&coded);
  }
  return bytes;
}

}  // namespace

// libprotobuf logs every string field of invalid UTF-8 it refuses: noise that slows the run.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = size_t{data[0]} + 1;
  const std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);

  rpc::FrameDecoder pieces;
  std::vector<rpc::Envelope> received;
  rubato::Status status;
  for (size_t begin = 0; begin < stream.size() && status.ok(); begin += piece) {
    status = pieces.Feed(stream.substr(begin, piece), &received);
  }
  if (!status.ok() && (!pieces.failed() || pieces.Feed("R", &received).ok())) __builtin_trap();

  rpc::FrameDecoder whole;
  std::vector<rpc::Envelope> at_once;
  const rubato::Status whole_status = whole.Feed(stream, &at_once);
  if (whole_status.code() != status.code() || at_once.size() != received.size()) __builtin_trap();

  for (size_t i = 0; i < received.size(); ++i) {
    const rpc::Envelope& envelope = received[i];
    if (Canonical(envelope) != Canonical(at_once[i])) __builtin_trap();
    if (rpc::BodyName(envelope) == "unknown") __builtin_trap();
    if (envelope.has_error()) static_cast<void>(rpc::StatusFromError(envelope.error()));
    const auto frame = rpc::EncodeFrame(envelope);
    if (!frame.ok()) continue;  // re-encoding may grow past the limit (canonical varints)
    rpc::FrameDecoder again;
    std::vector<rpc::Envelope> decoded;
    if (!again.Feed(*frame, &decoded).ok() || decoded.size() != 1 ||
        Canonical(decoded[0]) != Canonical(envelope)) {
      __builtin_trap();
    }
  }
  return 0;
}
