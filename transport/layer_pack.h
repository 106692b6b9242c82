// The layer-pack wire format: the data-plane messages between an inference rank and a cache rank
// for one step. A KV pack carries the new K / V (and optionally the last query) of P layers for
// B requests; a reply pack the selected positions and compact K / V rows, or the attention
// output and log-sum-exp of the query over the request's stored KV. Both are a 64-byte
// header, a request table and 16-byte aligned payload sections, little-endian; the size follows
// from header and table alone. LayerPackView::Parse validates an untrusted buffer completely
// before exposing any span. Layout in full: docs/transport.md "The layer-pack wire format".
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace rubato {

inline constexpr char kLayerPackMagic[4] = {'R', 'B', 'L', 'P'};
// 2: the request table's attention_queries and the reply's attention sections (1 had neither).
// 3: delta replies (kLayerPackFlagDelta, the entries' delta_rows / delta_reset, the slots
// section).
inline constexpr uint16_t kLayerPackVersion = 3;
// Flag bits of LayerPackHeader::flags. Unknown bits are refused by Parse.
inline constexpr uint32_t kLayerPackFlagHasQuery = 1u << 0;
// Delta replies (transport/compact_delta.h): on a KV pack, the sender keeps a persistent compact
// pool per (request, layer, KV head) and asks for deltas; on a reply pack, each (layer, request)
// carries only the rows entering its pool, with their slots.
inline constexpr uint32_t kLayerPackFlagDelta = 1u << 1;
// Every payload section starts at a multiple of this many bytes from the message start.
inline constexpr uint64_t kLayerPackSectionAlignment = 16;

enum class LayerPackKind : uint8_t { kKvPack = 1, kReplyPack = 2 };

// The fixed header as it lies on the wire (little-endian, no implicit padding).
struct LayerPackHeader {
  char magic[4];             // "RBLP"
  uint16_t version;          // kLayerPackVersion
  uint8_t kind;              // LayerPackKind
  uint8_t dtype;             // wire dtype code: 0 f32, 1 bf16, 2 f16 (K, V, Q element type)
  uint64_t step;             // decode / prefill-chunk step of the inference rank
  uint32_t first_layer;      // the pack carries layers [first_layer, first_layer + num_layers)
  uint32_t num_layers;       // P >= 1
  uint32_t batch;            // B >= 1: entries in the request table
  uint32_t num_kv_heads;     // >= 1
  uint32_t num_query_heads;  // >= 1, a multiple of num_kv_heads (GQA)
  uint32_t head_dim;         // >= 1
  uint32_t flags;            // kLayerPackFlagHasQuery (KV packs only), kLayerPackFlagDelta
  uint32_t reserved0;        // 0
  uint64_t total_bytes;      // size of the whole message: header + table + payload
  uint64_t reserved1;        // 0
};
static_assert(sizeof(LayerPackHeader) == 64, "LayerPackHeader is 64 bytes on the wire");

// One request-table entry as it lies on the wire.
struct LayerPackRequestEntry {
  uint64_t session_id;      // cache-rank session (KvStore::OpenSession)
  uint32_t first_position;  // position of the first new token (== tokens stored before it)
  uint32_t new_tokens;      // >= 1: 1 in decode, the chunk length for a prefill chunk
  uint32_t reply_slots;     // positions per KV head the reply carries (selection budget)
  uint32_t attention_queries;  // 0 or 1: the reply carries the attention of the last new
                               // token's query (the KV pack's query section) over positions
                               // [0, first_position + new_tokens); needs the query
  uint32_t delta_rows;   // delta replies: entering rows per KV head the reply has room for
                         // (<= reply_slots); 0 in a KV pack and without kLayerPackFlagDelta
  uint32_t delta_reset;  // 0 or 1, delta packs only: in a KV pack, the sender's pool is empty
                         // (send every row); in a reply, the pool is emptied first
};
static_assert(sizeof(LayerPackRequestEntry) == 32, "LayerPackRequestEntry is 32 bytes");

// The header fields a caller chooses (batch comes from the request table, total_bytes is
// computed, has_query is ignored for reply packs, which carry no query).
struct LayerPackShape {
  LayerPackKind kind = LayerPackKind::kKvPack;
  uint64_t step = 0;
  uint32_t first_layer = 0;
  uint32_t num_layers = 1;
  DType dtype = DType::kF32;
  uint32_t num_kv_heads = 1;
  uint32_t num_query_heads = 1;
  uint32_t head_dim = 1;
  bool has_query = false;
  bool delta = false;  // kLayerPackFlagDelta
};

// One request of a pack (the request-table entry without its reserved fields).
struct LayerPackRequest {
  uint64_t session_id = 0;
  uint32_t first_position = 0;
  uint32_t new_tokens = 1;
  uint32_t reply_slots = 0;
  uint32_t attention_queries = 0;  // 0 or 1 (LayerPackRequestEntry)
  uint32_t delta_rows = 0;         // (LayerPackRequestEntry)
  uint32_t delta_reset = 0;        // 0 or 1 (LayerPackRequestEntry)

  friend bool operator==(const LayerPackRequest&, const LayerPackRequest&) = default;
};

// Where each section of one (layer, request) lies: offsets from the message start, sizes in
// bytes. Sections a pack kind does not carry have bytes == 0.
struct LayerPackSections {
  uint64_t key_offset = 0, key_bytes = 0;
  uint64_t value_offset = 0, value_bytes = 0;
  uint64_t query_offset = 0, query_bytes = 0;
  uint64_t counts_offset = 0, counts_bytes = 0;
  uint64_t positions_offset = 0, positions_bytes = 0;
  uint64_t output_offset = 0, output_bytes = 0;  // reply: attention output
  uint64_t lse_offset = 0, lse_bytes = 0;        // reply: attention log-sum-exp
  uint64_t slots_offset = 0, slots_bytes = 0;    // delta reply: the entering rows' pool slots
};

// Names one section of LayerPackSections (its offset and size members).
struct SectionField {
  uint64_t LayerPackSections::*offset;
  uint64_t LayerPackSections::*bytes;
};
inline constexpr SectionField kKeySection{&LayerPackSections::key_offset,
                                          &LayerPackSections::key_bytes};
inline constexpr SectionField kValueSection{&LayerPackSections::value_offset,
                                            &LayerPackSections::value_bytes};
inline constexpr SectionField kQuerySection{&LayerPackSections::query_offset,
                                            &LayerPackSections::query_bytes};
inline constexpr SectionField kCountsSection{&LayerPackSections::counts_offset,
                                             &LayerPackSections::counts_bytes};
inline constexpr SectionField kPositionsSection{&LayerPackSections::positions_offset,
                                                &LayerPackSections::positions_bytes};
inline constexpr SectionField kOutputSection{&LayerPackSections::output_offset,
                                             &LayerPackSections::output_bytes};
inline constexpr SectionField kLseSection{&LayerPackSections::lse_offset,
                                          &LayerPackSections::lse_bytes};
inline constexpr SectionField kSlotsSection{&LayerPackSections::slots_offset,
                                            &LayerPackSections::slots_bytes};

// The byte layout of one message, computed from shape + request table with overflow checks.
// Shared by the writer and the view; callers rarely need it directly.
class LayerPackLayout {
 public:
  // Refuses invalid shapes / entries (zero heads, query heads not a multiple of KV heads,
  // new_tokens 0, positions past INT32_MAX, attention_queries past 1 or without a query in a
  // KV pack, ...) and sizes that overflow 64 bits.
  static Result<LayerPackLayout> Compute(const LayerPackShape& shape,
                                         std::span<const LayerPackRequest> requests);

  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t payload_offset() const { return payload_offset_; }
  // Sections of (layer_index in [0, P), request in [0, B)); indices are not checked here.
  LayerPackSections Sections(uint32_t layer_index, uint32_t request) const;

 private:
  uint64_t total_bytes_ = 0;
  uint64_t payload_offset_ = 0;
  uint64_t layer_stride_ = 0;                    // bytes of one layer's B request blocks
  std::vector<LayerPackSections> request_sections_;  // [B], offsets relative to layer start
};

// Exact message sizes from the shape and request table (kind in `shape` is overridden).
Result<uint64_t> KvPackBytes(const LayerPackShape& shape,
                             std::span<const LayerPackRequest> requests);
Result<uint64_t> ReplyPackBytes(const LayerPackShape& shape,
                                std::span<const LayerPackRequest> requests);

// Fills a caller-provided buffer: Create writes the header, the request table and zero
// padding; the caller then writes each section through the spans below (whose element layout
// is the one in the file comment). Payload bytes the caller does not write keep whatever the
// buffer held: reply rows past a head's count must be zeroed by the caller (BuildReplyPack
// does). The writer does not own the buffer; it must outlive the writer.
class LayerPackWriter {
 public:
  // `out` must hold at least the computed size; the message is out[0, size_bytes()).
  static Result<LayerPackWriter> Create(const LayerPackShape& shape,
                                        std::span<const LayerPackRequest> requests,
                                        std::span<std::byte> out);

  uint64_t size_bytes() const { return layout_.total_bytes(); }
  std::span<std::byte> bytes() const { return {base_, layout_.total_bytes()}; }

  // Section spans of (layer_index in [0, P), request in [0, B)); empty for an index out of
  // range or a section this kind does not carry.
  std::span<std::byte> Key(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> Value(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> Query(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> Counts(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> Positions(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> AttentionOutput(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> AttentionLse(uint32_t layer_index, uint32_t request) const;
  std::span<std::byte> Slots(uint32_t layer_index, uint32_t request) const;

 private:
  LayerPackWriter(LayerPackLayout layout, std::byte* base, uint32_t num_layers, uint32_t batch)
      : layout_(std::move(layout)), base_(base), num_layers_(num_layers), batch_(batch) {}
  std::span<std::byte> Section(uint32_t layer_index, uint32_t request,
                               SectionField field) const;

  LayerPackLayout layout_;
  std::byte* base_;
  uint32_t num_layers_;
  uint32_t batch_;
};

// A validated, read-only view of a received message. Holds spans into the buffer, which must
// outlive the view.
class LayerPackView {
 public:
  // Validates everything listed in the file comment; errors name the field and both values.
  // The buffer must be exactly header.total_bytes long.
  static Result<LayerPackView> Parse(std::span<const std::byte> bytes);

  const LayerPackShape& shape() const { return shape_; }
  LayerPackKind kind() const { return shape_.kind; }
  uint64_t step() const { return shape_.step; }
  uint32_t first_layer() const { return shape_.first_layer; }
  uint32_t num_layers() const { return shape_.num_layers; }
  uint32_t batch() const { return static_cast<uint32_t>(requests_.size()); }
  DType dtype() const { return shape_.dtype; }
  uint32_t num_kv_heads() const { return shape_.num_kv_heads; }
  uint32_t num_query_heads() const { return shape_.num_query_heads; }
  uint32_t head_dim() const { return shape_.head_dim; }
  bool has_query() const { return shape_.has_query; }
  std::span<const LayerPackRequest> requests() const { return requests_; }
  std::span<const std::byte> bytes() const { return bytes_; }

  // Section spans as in LayerPackWriter (layer_index relative to first_layer).
  std::span<const std::byte> Key(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> Value(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> Query(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> Counts(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> Positions(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> AttentionOutput(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> AttentionLse(uint32_t layer_index, uint32_t request) const;
  std::span<const std::byte> Slots(uint32_t layer_index, uint32_t request) const;
  bool delta() const { return shape_.delta; }

 private:
  std::span<const std::byte> Section(uint32_t layer_index, uint32_t request,
                                     SectionField field) const;

  LayerPackShape shape_;
  std::vector<LayerPackRequest> requests_;
  LayerPackLayout layout_;
  std::span<const std::byte> bytes_;
};

// Reads element `index` of an int32 section (counts / positions) without alignment demands.
int32_t LoadInt32(std::span<const std::byte> section, size_t index);
void StoreInt32(std::span<std::byte> section, size_t index, int32_t value);

// Checks a reply pack's counts and positions: 0 <= count <= reply_slots, positions strictly
// ascending within [0, first_position + new_tokens), entries past count -1; every attention
// log-sum-exp finite. In a delta reply count is the pool's rows after applying, the entering
// rows are the positions before the first -1 (at most delta_rows, ascending), each with a
// distinct slot below count, and slots past them -1. Not part of Parse
// because it reads the whole index payload; a receiver that trusts its peer may skip it.
Status ValidateReplyContents(const LayerPackView& reply);

// The shape of a cache-rank session (the RPC's OpenSession) that packs are checked against.
struct SessionShape {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t num_query_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kF32;
  uint32_t capacity_tokens = 0;  // positions the session can hold
};

// Checks request `request` of a parsed pack against its session before any byte is written:
// layers within the model, heads / head_dim / dtype equal, first_position + new_tokens within
// capacity, reply_slots within the positions that will exist after the append.
// (attention_queries is bounded by the layout: 0 or 1, with the pack's query.)
Status ValidateAgainstSession(const LayerPackView& view, uint32_t request,
                              const SessionShape& session);

}  // namespace rubato
