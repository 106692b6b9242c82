// The cache rank's KV store (see kv_store.h): sessions and budget, all-or-nothing appends of
// KV layer packs, and gathers into compact buffers.
#include "cache_rank/kv_store.h"

#include <fmt/format.h>

#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "common/logging.h"

namespace rubato {

struct KvStore::Session {
  uint64_t id = 0;
  uint64_t request_id = 0;
  SessionShape shape;
  SessionKvStorage storage;    // keys then values, see kv_store.h
  uint64_t head_stride = 0;    // bytes of one [capacity][head_dim] block
  uint64_t values_offset = 0;  // byte offset of the values half
  uint32_t length = 0;         // tokens complete in every layer
  // The step in progress (next_layer > 0) and the last completed one.
  uint32_t next_layer = 0;
  uint64_t pending_step = 0;
  uint32_t pending_new_tokens = 0;
  bool has_completed_step = false;
  uint64_t last_completed_step = 0;

  uint64_t row_bytes() const { return uint64_t{shape.head_dim} * DTypeSize(shape.dtype); }
  std::byte* keys(uint32_t layer, uint32_t kv_head) const {
    return storage.data() + (uint64_t{layer} * shape.num_kv_heads + kv_head) * head_stride;
  }
  std::byte* values(uint32_t layer, uint32_t kv_head) const {
    return keys(layer, kv_head) + values_offset;
  }
  uint32_t LayerLength(uint32_t layer) const {
    return length + (layer < next_layer ? pending_new_tokens : 0u);
  }
};

namespace {

Status CheckSessionShape(const SessionShape& shape) {
  auto zero = [](std::string_view field) {
    return InvalidArgumentError(
        fmt::format("kv store: session shape field '{}' is 0, must be at least 1", field));
  };
  if (shape.num_layers == 0) return zero("num_layers");
  if (shape.num_kv_heads == 0) return zero("num_kv_heads");
  if (shape.num_query_heads == 0) return zero("num_query_heads");
  if (shape.head_dim == 0) return zero("head_dim");
  if (shape.capacity_tokens == 0) return zero("capacity_tokens");
  if (shape.num_query_heads % shape.num_kv_heads != 0) {
    return InvalidArgumentError(
        fmt::format("kv store: session num_query_heads {} is not a multiple of num_kv_heads {}",
                    shape.num_query_heads, shape.num_kv_heads));
  }
  if (shape.capacity_tokens > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
    return OutOfRangeError(
        fmt::format("kv store: session capacity_tokens {} exceeds the largest int32 position {}",
                    shape.capacity_tokens, std::numeric_limits<int32_t>::max()));
  }
  return Status::Ok();
}

}  // namespace

// 2 * layers * kv_heads * capacity * head_dim * dtype size, or an error on 64-bit overflow.
Result<uint64_t> KvSessionBytes(const SessionShape& shape) {
  uint64_t bytes = 2;
  for (uint64_t factor :
       {uint64_t{shape.num_layers}, uint64_t{shape.num_kv_heads}, uint64_t{shape.capacity_tokens},
        uint64_t{shape.head_dim}, uint64_t{DTypeSize(shape.dtype)}}) {
    if (__builtin_mul_overflow(bytes, factor, &bytes)) {
      return OutOfRangeError(fmt::format(
          "kv store: a session of {} layers x {} KV heads x {} tokens x head_dim {} ({}) "
          "overflows 64-bit sizes",
          shape.num_layers, shape.num_kv_heads, shape.capacity_tokens, shape.head_dim,
          DTypeName(shape.dtype)));
    }
  }
  return bytes;
}

KvStore::KvStore(KvStoreOptions options) : options_(std::move(options)) {
  if (options_.allocator == nullptr) options_.allocator = MakeHostKvStorageAllocator();
}

KvStore::~KvStore() = default;

Result<uint64_t> KvStore::OpenSession(uint64_t request_id, const SessionShape& shape) {
  RUBATO_RETURN_IF_ERROR(CheckSessionShape(shape));
  if (auto it = session_of_request_.find(request_id); it != session_of_request_.end()) {
    return InvalidArgumentError(
        fmt::format("kv store: request {} already has session {} open", request_id, it->second));
  }
  RUBATO_ASSIGN_OR_RETURN(const uint64_t bytes, KvSessionBytes(shape));
  const uint64_t in_use = bytes_reserved_.load(std::memory_order_relaxed);
  if (bytes > options_.budget_bytes || in_use > options_.budget_bytes - bytes) {
    return ResourceExhaustedError(fmt::format(
        "kv store: opening a session for request {} needs {} bytes ({} layers x {} KV heads x "
        "{} tokens x head_dim {}, {}, K and V) but {} of the budget's {} bytes are in use",
        request_id, bytes, shape.num_layers, shape.num_kv_heads, shape.capacity_tokens,
        shape.head_dim, DTypeName(shape.dtype), in_use, options_.budget_bytes));
  }
  RUBATO_ASSIGN_OR_RETURN(SessionKvStorage storage,
                          SessionKvStorage::Allocate(options_.allocator, bytes));
  auto session = std::make_unique<Session>();
  session->id = next_session_id_++;
  session->request_id = request_id;
  session->shape = shape;
  session->storage = std::move(storage);
  session->head_stride = uint64_t{shape.capacity_tokens} * session->row_bytes();
  session->values_offset = bytes / 2;
  const uint64_t id = session->id;
  sessions_.emplace(id, std::move(session));
  session_of_request_.emplace(request_id, id);
  sessions_open_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t reserved = bytes_reserved_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  // One thread opens sessions (the class comment): a plain max is enough.
  if (reserved > bytes_reserved_peak_.load(std::memory_order_relaxed)) {
    bytes_reserved_peak_.store(reserved, std::memory_order_relaxed);
  }
  RUBATO_LOG_DEBUG("cache_rank", "opened session {} for request {}: {} bytes ({} allocator)", id,
                   request_id, bytes, options_.allocator->name());
  return id;
}

Status KvStore::CloseSession(uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFoundError(fmt::format("kv store: CloseSession: session {} is not open", session_id));
  }
  const uint64_t bytes = it->second->storage.size();
  session_of_request_.erase(it->second->request_id);
  sessions_.erase(it);
  sessions_open_.fetch_sub(1, std::memory_order_relaxed);
  bytes_reserved_.fetch_sub(bytes, std::memory_order_relaxed);
  return Status::Ok();
}

Result<const KvStore::Session*> KvStore::Find(uint64_t session_id) const {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFoundError(fmt::format("kv store: session {} is not open", session_id));
  }
  return static_cast<const Session*>(it->second.get());
}

Result<KvStore::Session*> KvStore::FindMutable(uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFoundError(fmt::format("kv store: session {} is not open", session_id));
  }
  return it->second.get();
}

Result<SessionShape> KvStore::GetSessionShape(uint64_t session_id) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  return session->shape;
}

Result<uint32_t> KvStore::SessionLength(uint64_t session_id) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  return session->length;
}

Result<uint32_t> KvStore::LayerLength(uint64_t session_id, uint32_t layer) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  if (layer >= session->shape.num_layers) {
    return OutOfRangeError(
        fmt::format("kv store: session {}: layer {} is not below num_layers "
                    "{}",
                    session_id, layer, session->shape.num_layers));
  }
  return session->LayerLength(layer);
}

Status KvStore::AppendKvPack(const LayerPackView& pack) {
  if (pack.kind() != LayerPackKind::kKvPack) {
    return InvalidArgumentError(fmt::format(
        "kv store: AppendKvPack got a reply pack (step {}), it needs a kv pack", pack.step()));
  }
  // Pass 1: validate every request; nothing is written until all pass. Parse already refused
  // a session named twice in one pack.
  std::vector<Session*> sessions(pack.batch());
  for (uint32_t r = 0; r < pack.batch(); ++r) {
    const LayerPackRequest& request = pack.requests()[r];
    auto found = FindMutable(request.session_id);
    if (!found.ok()) {
      return found.status().WithContext(
          fmt::format("kv store: AppendKvPack step {}, request {}", pack.step(), r));
    }
    Session& s = **found;
    RUBATO_RETURN_IF_ERROR(ValidateAgainstSession(pack, r, s.shape));
    const std::string where = fmt::format(
        "kv store: AppendKvPack step {}, request {} (session "
        "{})",
        pack.step(), r, s.id);
    if (request.first_position != s.length) {
      return FailedPreconditionError(
          fmt::format("{}: first_position is {} but the session holds {} tokens (appends must be "
                      "contiguous)",
                      where, request.first_position, s.length));
    }
    if (pack.first_layer() != s.next_layer) {
      return FailedPreconditionError(fmt::format(
          "{}: the pack starts at layer {} but the session expects layer {} next (packs of a "
          "step arrive in layer order, without repeats or gaps)",
          where, pack.first_layer(), s.next_layer));
    }
    if (s.next_layer > 0) {
      if (pack.step() != s.pending_step || request.new_tokens != s.pending_new_tokens) {
        return FailedPreconditionError(fmt::format(
            "{}: step {} with {} new tokens, but the step in progress is step {} with {} new "
            "tokens",
            where, pack.step(), request.new_tokens, s.pending_step, s.pending_new_tokens));
      }
    } else if (s.has_completed_step && pack.step() <= s.last_completed_step) {
      return FailedPreconditionError(
          fmt::format("{}: step {} is not after the last completed step {}", where, pack.step(),
                      s.last_completed_step));
    }
    sessions[r] = &s;
  }
  // Pass 2: copy. Pack K / V of one (layer, request) is [kv_head][new_tokens][head_dim]; each
  // head's new rows are contiguous in the store too.
  uint64_t written = 0;
  for (uint32_t r = 0; r < pack.batch(); ++r) {
    Session& s = *sessions[r];
    const LayerPackRequest& request = pack.requests()[r];
    const uint64_t head_bytes = uint64_t{request.new_tokens} * s.row_bytes();
    const uint64_t at = uint64_t{request.first_position} * s.row_bytes();
    for (uint32_t l = 0; l < pack.num_layers(); ++l) {
      const uint32_t layer = pack.first_layer() + l;
      const std::byte* keys = pack.Key(l, r).data();
      const std::byte* values = pack.Value(l, r).data();
      for (uint32_t h = 0; h < s.shape.num_kv_heads; ++h) {
        std::memcpy(s.keys(layer, h) + at, keys + h * head_bytes, head_bytes);
        std::memcpy(s.values(layer, h) + at, values + h * head_bytes, head_bytes);
      }
      written += 2 * head_bytes * s.shape.num_kv_heads;
    }
    s.next_layer = pack.first_layer() + pack.num_layers();
    s.pending_step = pack.step();
    s.pending_new_tokens = request.new_tokens;
    if (s.next_layer == s.shape.num_layers) {  // the step's last layer: the tokens are whole
      s.length += request.new_tokens;
      s.next_layer = 0;
      s.pending_new_tokens = 0;
      s.has_completed_step = true;
      s.last_completed_step = pack.step();
    }
  }
  appends_.fetch_add(1, std::memory_order_relaxed);
  bytes_appended_.fetch_add(written, std::memory_order_relaxed);
  return Status::Ok();
}

Result<KvHeadRows> KvStore::HeadRows(uint64_t session_id, uint32_t layer, uint32_t kv_head) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* s, Find(session_id));
  if (layer >= s->shape.num_layers || kv_head >= s->shape.num_kv_heads) {
    return OutOfRangeError(fmt::format(
        "kv store: session {}: layer {} / kv head {} outside num_layers {} / num_kv_heads {}",
        session_id, layer, kv_head, s->shape.num_layers, s->shape.num_kv_heads));
  }
  KvHeadRows rows;
  rows.keys = {s->keys(layer, kv_head), s->head_stride};
  rows.values = {s->values(layer, kv_head), s->head_stride};
  rows.readable_tokens = s->LayerLength(layer);
  rows.head_dim = s->shape.head_dim;
  rows.dtype = s->shape.dtype;
  return rows;
}

Status KvStore::Gather(uint64_t session_id, uint32_t layer, uint32_t kv_head,
                       std::span<const int32_t> positions, std::span<std::byte> out_keys,
                       std::span<std::byte> out_values) {
  RUBATO_ASSIGN_OR_RETURN(const KvHeadRows rows, HeadRows(session_id, layer, kv_head));
  const uint64_t row_bytes = uint64_t{rows.head_dim} * DTypeSize(rows.dtype);
  uint64_t needed = 0;
  const bool overflow = __builtin_mul_overflow(uint64_t{positions.size()}, row_bytes, &needed);
  if (overflow || out_keys.size() < needed || out_values.size() < needed) {
    return InvalidArgumentError(fmt::format(
        "kv store: Gather of {} rows (session {}, layer {}, kv head {}) needs {} bytes per "
        "output, out_keys has {} and out_values {}",
        positions.size(), session_id, layer, kv_head, needed, out_keys.size(), out_values.size()));
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0 || static_cast<uint32_t>(positions[i]) >= rows.readable_tokens) {
      return OutOfRangeError(fmt::format(
          "kv store: Gather (session {}, layer {}, kv head {}): positions[{}] = {} is outside "
          "the {} stored tokens",
          session_id, layer, kv_head, i, positions[i], rows.readable_tokens));
    }
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    const uint64_t at = static_cast<uint64_t>(positions[i]) * row_bytes;
    std::memcpy(out_keys.data() + i * row_bytes, rows.keys.data() + at, row_bytes);
    std::memcpy(out_values.data() + i * row_bytes, rows.values.data() + at, row_bytes);
  }
  gathers_.fetch_add(1, std::memory_order_relaxed);
  gathered_rows_.fetch_add(positions.size(), std::memory_order_relaxed);
  return Status::Ok();
}

KvStoreStats KvStore::Stats() const {
  KvStoreStats stats;
  stats.sessions_open = sessions_open_.load(std::memory_order_relaxed);
  stats.bytes_reserved = bytes_reserved_.load(std::memory_order_relaxed);
  stats.bytes_reserved_peak = bytes_reserved_peak_.load(std::memory_order_relaxed);
  stats.budget_bytes = options_.budget_bytes;
  stats.appends = appends_.load(std::memory_order_relaxed);
  stats.bytes_appended = bytes_appended_.load(std::memory_order_relaxed);
  stats.gathers = gathers_.load(std::memory_order_relaxed);
  stats.gathered_rows = gathered_rows_.load(std::memory_order_relaxed);
  return stats;
}

}  // namespace rubato
