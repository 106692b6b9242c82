// The layer-pack wire format (see layer_pack.h): layout computation with overflow-checked size
// arithmetic, the writer, the validating parser, and the checks against a session.
#include "transport/layer_pack.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

namespace rubato {

static_assert(std::endian::native == std::endian::little,
              "the layer-pack wire format is little-endian and read by memcpy");
static_assert(offsetof(LayerPackHeader, version) == 4 && offsetof(LayerPackHeader, kind) == 6 &&
              offsetof(LayerPackHeader, dtype) == 7 && offsetof(LayerPackHeader, step) == 8 &&
              offsetof(LayerPackHeader, first_layer) == 16 &&
              offsetof(LayerPackHeader, num_layers) == 20 &&
              offsetof(LayerPackHeader, batch) == 24 &&
              offsetof(LayerPackHeader, num_kv_heads) == 28 &&
              offsetof(LayerPackHeader, num_query_heads) == 32 &&
              offsetof(LayerPackHeader, head_dim) == 36 &&
              offsetof(LayerPackHeader, flags) == 40 &&
              offsetof(LayerPackHeader, reserved0) == 44 &&
              offsetof(LayerPackHeader, total_bytes) == 48 &&
              offsetof(LayerPackHeader, reserved1) == 56);
static_assert(offsetof(LayerPackRequestEntry, first_position) == 8 &&
              offsetof(LayerPackRequestEntry, new_tokens) == 12 &&
              offsetof(LayerPackRequestEntry, reply_slots) == 16 &&
              offsetof(LayerPackRequestEntry, attention_queries) == 20 &&
              offsetof(LayerPackRequestEntry, delta_rows) == 24 &&
              offsetof(LayerPackRequestEntry, delta_reset) == 28);

namespace {

constexpr uint64_t kHeaderBytes = sizeof(LayerPackHeader);
constexpr uint64_t kEntryBytes = sizeof(LayerPackRequestEntry);
constexpr uint64_t kMaxPosition = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());

// Wire dtype codes, fixed here rather than taken from the DType enum's values.
uint8_t WireDType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 0;
    case DType::kBF16: return 1;
    case DType::kF16: return 2;
  }
  return 0xff;
}

Result<DType> DTypeFromWire(uint8_t code) {
  switch (code) {
    case 0: return DType::kF32;
    case 1: return DType::kBF16;
    case 2: return DType::kF16;
    default:
      return DataLossError(fmt::format(
          "layer pack: header field 'dtype' is {}, expected 0 (f32), 1 (bf16) or 2 (f16)", code));
  }
}

std::string_view KindName(LayerPackKind kind) {
  return kind == LayerPackKind::kKvPack ? "kv pack" : "reply pack";
}

// 64-bit size arithmetic that remembers whether any step overflowed.
class CheckedSize {
 public:
  uint64_t Mul(uint64_t a, uint64_t b) {
    uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) overflow_ = true;
    return r;
  }
  uint64_t Add(uint64_t a, uint64_t b) {
    uint64_t r = 0;
    if (__builtin_add_overflow(a, b, &r)) overflow_ = true;
    return r;
  }
  uint64_t Align(uint64_t a) {
    return Add(a, kLayerPackSectionAlignment - 1) & ~(kLayerPackSectionAlignment - 1);
  }
  bool overflow() const { return overflow_; }

 private:
  bool overflow_ = false;
};

Status CheckShape(const LayerPackShape& shape, size_t batch) {
  if (shape.kind != LayerPackKind::kKvPack && shape.kind != LayerPackKind::kReplyPack) {
    return InvalidArgumentError(fmt::format("layer pack: kind {} is neither 1 (kv pack) nor 2 "
                                            "(reply pack)", static_cast<int>(shape.kind)));
  }
  if (WireDType(shape.dtype) == 0xff) {
    return InvalidArgumentError("layer pack: dtype is not f32, bf16 or f16");
  }
  auto zero = [](std::string_view field) {
    return InvalidArgumentError(fmt::format("layer pack: '{}' is 0, must be at least 1", field));
  };
  if (shape.num_layers == 0) return zero("num_layers");
  if (batch == 0) return zero("batch");
  if (shape.num_kv_heads == 0) return zero("num_kv_heads");
  if (shape.num_query_heads == 0) return zero("num_query_heads");
  if (shape.head_dim == 0) return zero("head_dim");
  if (batch > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgumentError(fmt::format("layer pack: batch {} exceeds {}", batch,
                                            std::numeric_limits<uint32_t>::max()));
  }
  if (shape.num_query_heads % shape.num_kv_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "layer pack: num_query_heads {} is not a multiple of num_kv_heads {}",
        shape.num_query_heads, shape.num_kv_heads));
  }
  if (static_cast<uint64_t>(shape.first_layer) + shape.num_layers >
      std::numeric_limits<uint32_t>::max()) {
    return InvalidArgumentError(fmt::format("layer pack: first_layer {} + num_layers {} "
                                            "overflows 32 bits", shape.first_layer,
                                            shape.num_layers));
  }
  return Status::Ok();
}

Status CheckRequest(const LayerPackShape& shape, const LayerPackRequest& request, size_t index) {
  if (request.new_tokens == 0) {
    return InvalidArgumentError(
        fmt::format("layer pack: request {} (session {}): 'new_tokens' is 0, must be at least 1",
                    index, request.session_id));
  }
  const uint64_t end = static_cast<uint64_t>(request.first_position) + request.new_tokens;
  if (end > kMaxPosition) {
    return OutOfRangeError(fmt::format(
        "layer pack: request {} (session {}): first_position {} + new_tokens {} = {} exceeds "
        "the largest int32 position {}",
        index, request.session_id, request.first_position, request.new_tokens, end,
        kMaxPosition));
  }
  if (request.reply_slots > kMaxPosition) {
    return OutOfRangeError(fmt::format(
        "layer pack: request {} (session {}): 'reply_slots' {} exceeds {}", index,
        request.session_id, request.reply_slots, kMaxPosition));
  }
  // One query row per request: the KV pack's query section holds the last new token's.
  if (request.attention_queries > 1) {
    return InvalidArgumentError(fmt::format(
        "layer pack: request {} (session {}): 'attention_queries' is {}, must be 0 or 1", index,
        request.session_id, request.attention_queries));
  }
  if (request.attention_queries > 0 && shape.kind == LayerPackKind::kKvPack && !shape.has_query) {
    return InvalidArgumentError(fmt::format(
        "layer pack: request {} (session {}): 'attention_queries' is {} but the kv pack carries "
        "no query", index, request.session_id, request.attention_queries));
  }
  const bool delta_reply = shape.delta && shape.kind == LayerPackKind::kReplyPack;
  if ((request.delta_rows > 0 && !delta_reply) || request.delta_rows > request.reply_slots) {
    return InvalidArgumentError(fmt::format(
        "layer pack: request {} (session {}): 'delta_rows' is {}; it must be 0 outside a delta "
        "reply and at most reply_slots {}", index, request.session_id, request.delta_rows,
        request.reply_slots));
  }
  if (request.delta_reset > 1 || (request.delta_reset > 0 && !shape.delta)) {
    return InvalidArgumentError(fmt::format(
        "layer pack: request {} (session {}): 'delta_reset' is {}; it must be 0 or 1, and 0 "
        "outside a delta pack", index, request.session_id, request.delta_reset));
  }
  return Status::Ok();
}

}  // namespace

Result<LayerPackLayout> LayerPackLayout::Compute(const LayerPackShape& shape,
                                                 std::span<const LayerPackRequest> requests) {
  RUBATO_RETURN_IF_ERROR(CheckShape(shape, requests.size()));
  for (size_t r = 0; r < requests.size(); ++r) {
    RUBATO_RETURN_IF_ERROR(CheckRequest(shape, requests[r], r));
  }
  CheckedSize math;
  LayerPackLayout layout;
  const uint64_t elem = DTypeSize(shape.dtype);
  const uint64_t row = math.Mul(shape.head_dim, elem);  // one [head_dim] row
  layout.payload_offset_ =
      math.Align(math.Add(kHeaderBytes, math.Mul(kEntryBytes, requests.size())));
  layout.request_sections_.resize(requests.size());
  uint64_t offset = 0;  // relative to the start of a layer's block
  // Appends a section of `bytes` at the current (aligned) offset and returns its offset.
  auto place = [&](uint64_t bytes, uint64_t& at, uint64_t& size) {
    at = offset;
    size = bytes;
    offset = math.Align(math.Add(offset, bytes));
  };
  for (size_t r = 0; r < requests.size(); ++r) {
    LayerPackSections& s = layout.request_sections_[r];
    if (shape.kind == LayerPackKind::kKvPack) {
      const uint64_t kv = math.Mul(math.Mul(shape.num_kv_heads, requests[r].new_tokens), row);
      place(kv, s.key_offset, s.key_bytes);
      place(kv, s.value_offset, s.value_bytes);
      if (shape.has_query) place(math.Mul(shape.num_query_heads, row), s.query_offset,
                                 s.query_bytes);
    } else {
      // A delta reply carries delta_rows rows per KV head (and their slots), a full one
      // reply_slots.
      const uint64_t rows = shape.delta ? requests[r].delta_rows : requests[r].reply_slots;
      const uint64_t slots = math.Mul(shape.num_kv_heads, rows);
      place(math.Mul(shape.num_kv_heads, 4), s.counts_offset, s.counts_bytes);
      if (shape.delta) place(math.Mul(slots, 4), s.slots_offset, s.slots_bytes);
      place(math.Mul(slots, 4), s.positions_offset, s.positions_bytes);
      place(math.Mul(slots, row), s.key_offset, s.key_bytes);
      place(math.Mul(slots, row), s.value_offset, s.value_bytes);
      // The attention sections are f32 whatever the K / V dtype.
      const uint64_t heads = math.Mul(requests[r].attention_queries, shape.num_query_heads);
      place(math.Mul(math.Mul(heads, shape.head_dim), 4), s.output_offset, s.output_bytes);
      place(math.Mul(heads, 4), s.lse_offset, s.lse_bytes);
    }
  }
  layout.layer_stride_ = offset;
  layout.total_bytes_ =
      math.Add(layout.payload_offset_, math.Mul(layout.layer_stride_, shape.num_layers));
  if (math.overflow()) {
    return OutOfRangeError(fmt::format(
        "layer pack: the size of a {} with num_layers {}, batch {}, num_kv_heads {}, "
        "num_query_heads {}, head_dim {} overflows 64 bits",
        KindName(shape.kind), shape.num_layers, requests.size(), shape.num_kv_heads,
        shape.num_query_heads, shape.head_dim));
  }
  return layout;
}

LayerPackSections LayerPackLayout::Sections(uint32_t layer_index, uint32_t request) const {
  LayerPackSections s = request_sections_[request];
  const uint64_t base = payload_offset_ + layer_stride_ * layer_index;
  s.key_offset += base;
  s.value_offset += base;
  s.query_offset += base;
  s.counts_offset += base;
  s.positions_offset += base;
  s.output_offset += base;
  s.lse_offset += base;
  s.slots_offset += base;
  return s;
}

Result<uint64_t> KvPackBytes(const LayerPackShape& shape,
                             std::span<const LayerPackRequest> requests) {
  LayerPackShape kv = shape;
  kv.kind = LayerPackKind::kKvPack;
  RUBATO_ASSIGN_OR_RETURN(LayerPackLayout layout, LayerPackLayout::Compute(kv, requests));
  return layout.total_bytes();
}

Result<uint64_t> ReplyPackBytes(const LayerPackShape& shape,
                                std::span<const LayerPackRequest> requests) {
  LayerPackShape reply = shape;
  reply.kind = LayerPackKind::kReplyPack;
  reply.has_query = false;
  RUBATO_ASSIGN_OR_RETURN(LayerPackLayout layout, LayerPackLayout::Compute(reply, requests));
  return layout.total_bytes();
}

// ---- writer -----------------------------------------------------------------------------

Result<LayerPackWriter> LayerPackWriter::Create(const LayerPackShape& shape,
                                                std::span<const LayerPackRequest> requests,
                                                std::span<std::byte> out) {
  LayerPackShape normalized = shape;
  if (normalized.kind == LayerPackKind::kReplyPack) normalized.has_query = false;
  RUBATO_ASSIGN_OR_RETURN(LayerPackLayout layout,
                          LayerPackLayout::Compute(normalized, requests));
  if (out.size() < layout.total_bytes()) {
    return InvalidArgumentError(fmt::format(
        "layer pack writer: the output buffer has {} bytes, the {} needs {}", out.size(),
        KindName(normalized.kind), layout.total_bytes()));
  }
  LayerPackHeader header{};
  std::memcpy(header.magic, kLayerPackMagic, sizeof(header.magic));
  header.version = kLayerPackVersion;
  header.kind = static_cast<uint8_t>(normalized.kind);
  header.dtype = WireDType(normalized.dtype);
  header.step = normalized.step;
  header.first_layer = normalized.first_layer;
  header.num_layers = normalized.num_layers;
  header.batch = static_cast<uint32_t>(requests.size());
  header.num_kv_heads = normalized.num_kv_heads;
  header.num_query_heads = normalized.num_query_heads;
  header.head_dim = normalized.head_dim;
  header.flags = (normalized.has_query ? kLayerPackFlagHasQuery : 0u) |
                 (normalized.delta ? kLayerPackFlagDelta : 0u);
  header.total_bytes = layout.total_bytes();
  std::byte* base = out.data();
  std::memcpy(base, &header, sizeof(header));
  for (size_t r = 0; r < requests.size(); ++r) {
    LayerPackRequestEntry entry{};
    entry.session_id = requests[r].session_id;
    entry.first_position = requests[r].first_position;
    entry.new_tokens = requests[r].new_tokens;
    entry.reply_slots = requests[r].reply_slots;
    entry.attention_queries = requests[r].attention_queries;
    entry.delta_rows = requests[r].delta_rows;
    entry.delta_reset = requests[r].delta_reset;
    std::memcpy(base + kHeaderBytes + r * kEntryBytes, &entry, sizeof(entry));
  }
  // Zero the padding after the table and after every section, so that a message's bytes are a
  // function of its contents (no stale buffer bytes travel).
  const uint64_t table_end = kHeaderBytes + requests.size() * kEntryBytes;
  std::memset(base + table_end, 0, layout.payload_offset() - table_end);
  auto pad = [&](uint64_t offset, uint64_t bytes) {
    const uint64_t end = offset + bytes;
    const uint64_t aligned = (end + kLayerPackSectionAlignment - 1) &
                             ~(kLayerPackSectionAlignment - 1);
    std::memset(base + end, 0, aligned - end);
  };
  for (uint32_t l = 0; l < normalized.num_layers; ++l) {
    for (uint32_t r = 0; r < requests.size(); ++r) {
      const LayerPackSections s = layout.Sections(l, r);
      if (normalized.kind == LayerPackKind::kKvPack) {
        pad(s.key_offset, s.key_bytes);
        pad(s.value_offset, s.value_bytes);
        if (normalized.has_query) pad(s.query_offset, s.query_bytes);
      } else {
        pad(s.counts_offset, s.counts_bytes);
        if (normalized.delta) pad(s.slots_offset, s.slots_bytes);
        pad(s.positions_offset, s.positions_bytes);
        pad(s.key_offset, s.key_bytes);
        pad(s.value_offset, s.value_bytes);
        pad(s.output_offset, s.output_bytes);
        pad(s.lse_offset, s.lse_bytes);
      }
    }
  }
  return LayerPackWriter(std::move(layout), base, normalized.num_layers,
                         static_cast<uint32_t>(requests.size()));
}

std::span<std::byte> LayerPackWriter::Section(uint32_t layer_index, uint32_t request,
                                              SectionField field) const {
  if (layer_index >= num_layers_ || request >= batch_) return {};
  const LayerPackSections s = layout_.Sections(layer_index, request);
  if (s.*field.bytes == 0) return {};
  return {base_ + s.*field.offset, s.*field.bytes};
}

std::span<std::byte> LayerPackWriter::Key(uint32_t l, uint32_t r) const {
  return Section(l, r, kKeySection);
}
std::span<std::byte> LayerPackWriter::Value(uint32_t l, uint32_t r) const {
  return Section(l, r, kValueSection);
}
std::span<std::byte> LayerPackWriter::Query(uint32_t l, uint32_t r) const {
  return Section(l, r, kQuerySection);
}
std::span<std::byte> LayerPackWriter::Counts(uint32_t l, uint32_t r) const {
  return Section(l, r, kCountsSection);
}
std::span<std::byte> LayerPackWriter::Positions(uint32_t l, uint32_t r) const {
  return Section(l, r, kPositionsSection);
}
std::span<std::byte> LayerPackWriter::AttentionOutput(uint32_t l, uint32_t r) const {
  return Section(l, r, kOutputSection);
}
std::span<std::byte> LayerPackWriter::AttentionLse(uint32_t l, uint32_t r) const {
  return Section(l, r, kLseSection);
}
std::span<std::byte> LayerPackWriter::Slots(uint32_t l, uint32_t r) const {
  return Section(l, r, kSlotsSection);
}

// ---- view ------------------------------------------------------------------------------

Result<LayerPackView> LayerPackView::Parse(std::span<const std::byte> bytes) {
  if (bytes.size() < kHeaderBytes) {
    return DataLossError(fmt::format("layer pack: the buffer has {} bytes, fewer than the "
                                     "{}-byte header", bytes.size(), kHeaderBytes));
  }
  LayerPackHeader header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  if (std::memcmp(header.magic, kLayerPackMagic, sizeof(header.magic)) != 0) {
    uint32_t magic = 0;
    std::memcpy(&magic, header.magic, sizeof(magic));
    return DataLossError(fmt::format(
        "layer pack: header field 'magic' is 0x{:08x}, expected 0x{:08x} (\"RBLP\")", magic,
        0x504c4252u));
  }
  if (header.version != kLayerPackVersion) {
    return UnsupportedError(fmt::format(
        "layer pack: header field 'version' is {}, this build reads version {} (the peer runs "
        "another rubato version)", header.version, kLayerPackVersion));
  }
  if (header.kind != static_cast<uint8_t>(LayerPackKind::kKvPack) &&
      header.kind != static_cast<uint8_t>(LayerPackKind::kReplyPack)) {
    return DataLossError(fmt::format(
        "layer pack: header field 'kind' is {}, expected 1 (kv pack) or 2 (reply pack)",
        header.kind));
  }
  LayerPackShape shape;
  shape.kind = static_cast<LayerPackKind>(header.kind);
  RUBATO_ASSIGN_OR_RETURN(shape.dtype, DTypeFromWire(header.dtype));
  const uint32_t allowed_flags =
      (shape.kind == LayerPackKind::kKvPack ? kLayerPackFlagHasQuery : 0u) | kLayerPackFlagDelta;
  if ((header.flags & ~allowed_flags) != 0) {
    return DataLossError(fmt::format(
        "layer pack: header field 'flags' is 0x{:x}, a {} allows only 0x{:x}", header.flags,
        KindName(shape.kind), allowed_flags));
  }
  if (header.reserved0 != 0 || header.reserved1 != 0) {
    return DataLossError(fmt::format(
        "layer pack: header fields 'reserved0' / 'reserved1' are {} / {}, expected 0 / 0",
        header.reserved0, header.reserved1));
  }
  if (header.total_bytes != bytes.size()) {
    return DataLossError(fmt::format(
        "layer pack: header field 'total_bytes' is {} but the buffer has {} bytes",
        header.total_bytes, bytes.size()));
  }
  // batch < 2^32, so the table size cannot overflow; it must lie inside the buffer before
  // anything is allocated for it.
  const uint64_t table_end = kHeaderBytes + kEntryBytes * uint64_t{header.batch};
  if (table_end > bytes.size()) {
    return DataLossError(fmt::format(
        "layer pack: header field 'batch' is {}: its request table ends at byte {} but the "
        "message has {} bytes", header.batch, table_end, bytes.size()));
  }
  shape.step = header.step;
  shape.first_layer = header.first_layer;
  shape.num_layers = header.num_layers;
  shape.num_kv_heads = header.num_kv_heads;
  shape.num_query_heads = header.num_query_heads;
  shape.head_dim = header.head_dim;
  shape.has_query = (header.flags & kLayerPackFlagHasQuery) != 0;
  shape.delta = (header.flags & kLayerPackFlagDelta) != 0;

  LayerPackView view;
  view.requests_.resize(header.batch);
  std::unordered_set<uint64_t> sessions;
  sessions.reserve(header.batch);
  for (uint32_t r = 0; r < header.batch; ++r) {
    LayerPackRequestEntry entry;
    std::memcpy(&entry, bytes.data() + kHeaderBytes + r * kEntryBytes, sizeof(entry));
    if (!sessions.insert(entry.session_id).second) {
      return DataLossError(fmt::format(
          "layer pack: request {} repeats session id {} (a session appears once per pack)", r,
          entry.session_id));
    }
    view.requests_[r] = LayerPackRequest{entry.session_id, entry.first_position,
                                         entry.new_tokens, entry.reply_slots,
                                         entry.attention_queries, entry.delta_rows,
                                         entry.delta_reset};
  }
  auto layout = LayerPackLayout::Compute(shape, view.requests_);
  if (!layout.ok()) {  // a header or table the sender could not have written: corrupt
    return Status(StatusCode::kDataLoss, layout.status().message());
  }
  if (layout->total_bytes() != header.total_bytes) {
    return DataLossError(fmt::format(
        "layer pack: header field 'total_bytes' is {} but its header and request table "
        "describe a {}-byte {}", header.total_bytes, layout->total_bytes(),
        KindName(shape.kind)));
  }
  view.shape_ = shape;
  view.layout_ = std::move(layout).value();
  view.bytes_ = bytes;
  return view;
}

std::span<const std::byte> LayerPackView::Section(uint32_t layer_index, uint32_t request,
                                                  SectionField field) const {
  if (layer_index >= num_layers() || request >= batch()) return {};
  const LayerPackSections s = layout_.Sections(layer_index, request);
  if (s.*field.bytes == 0) return {};
  return bytes_.subspan(s.*field.offset, s.*field.bytes);
}

std::span<const std::byte> LayerPackView::Key(uint32_t l, uint32_t r) const {
  return Section(l, r, kKeySection);
}
std::span<const std::byte> LayerPackView::Value(uint32_t l, uint32_t r) const {
  return Section(l, r, kValueSection);
}
std::span<const std::byte> LayerPackView::Query(uint32_t l, uint32_t r) const {
  return Section(l, r, kQuerySection);
}
std::span<const std::byte> LayerPackView::Counts(uint32_t l, uint32_t r) const {
  return Section(l, r, kCountsSection);
}
std::span<const std::byte> LayerPackView::Positions(uint32_t l, uint32_t r) const {
  return Section(l, r, kPositionsSection);
}
std::span<const std::byte> LayerPackView::AttentionOutput(uint32_t l, uint32_t r) const {
  return Section(l, r, kOutputSection);
}
std::span<const std::byte> LayerPackView::AttentionLse(uint32_t l, uint32_t r) const {
  return Section(l, r, kLseSection);
}
std::span<const std::byte> LayerPackView::Slots(uint32_t l, uint32_t r) const {
  return Section(l, r, kSlotsSection);
}

int32_t LoadInt32(std::span<const std::byte> section, size_t index) {
  int32_t value;
  std::memcpy(&value, section.data() + index * sizeof(value), sizeof(value));
  return value;
}

void StoreInt32(std::span<std::byte> section, size_t index, int32_t value) {
  std::memcpy(section.data() + index * sizeof(value), &value, sizeof(value));
}

}  // namespace rubato
