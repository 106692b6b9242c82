// The inference rank's side of offloaded KV: CacheRankClient turns the model's per-layer K/V
// (kv_offload.h) into layer packs in the session's dtype sent to a cache rank over a Transport,
// serves each decode token's compact KV or partial attention from the replies (sized by the
// session's cache selector), and opens and
// closes sessions through a CacheSessionControl. Every wait is bounded; after a data-plane
// failure the client stays broken with that error. docs/disaggregated.md "The cache client".
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "common/hf_config.h"
#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "transport/compact_delta.h"
#include "transport/layer_pack.h"
#include "transport/pack_protocol.h"
#include "transport/transport.h"

namespace rubato {

// Opens and closes sessions on the cache rank and says whether it is alive.
class CacheSessionControl {
 public:
  virtual ~CacheSessionControl() = default;
  virtual Result<uint64_t> OpenSession(uint64_t request_id, const SessionShape& shape,
                                       const CacheSelectorSpec& selection) = 0;
  virtual Status CloseSession(uint64_t session_id) = 0;
  // Ok while the cache rank answers (RPC heartbeats); else why not.
  virtual Status Health() = 0;
};

struct CacheClientOptions {
  // P; 1 for a selector that serves the same step (its reply is needed before the layer's
  // attention).
  int pack_layers = 4;
  CacheSelectorSpec selection;
  // The sessions' K / V dtype, on the wire and in the cache rank's store: the model's (f32 for
  // the CPU model, bf16 for the CUDA model). The model's buffers are converted when they differ.
  DType kv_dtype = DType::kF32;
  std::chrono::milliseconds timeout{5000};  // longest wait for a reply or a send
  std::string cache_name = "cache rank";    // names the peer in errors ("cache rank 10.0.0.2:7000")
  // For a selector that replies rows (oracle_topk): keep a persistent compact pool per
  // (session, layer, KV head) and take delta replies (only the rows entering each pool);
  // false: every reply carries every selected row. docs/disaggregated.md "Delta replies".
  bool delta_replies = true;
};

class CacheRankClient final : public KvOffloadClient {
 public:
  // `transport` and `control` must outlive the client; `cache_peer` is the cache rank's rank in
  // the transport. A selection the selector table refuses leaves the client broken (Broken()).
  CacheRankClient(const CacheClientOptions& options, const ModelConfig& model,
                  transport::Transport& transport, int cache_peer, CacheSessionControl& control);
  ~CacheRankClient() override;

  CacheRankClient(const CacheRankClient&) = delete;
  CacheRankClient& operator=(const CacheRankClient&) = delete;

  // A session for a request of up to `capacity_tokens` positions (prompt + generated).
  Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) override;
  Status CloseSession(uint64_t session_id) override;
  Status Broken() const override { return broken_; }

  Status LayerComputed(int layer, std::span<const OffloadLayerKv> entries) override;
  // Compact KV for a selector that replies rows (oracle_topk); f32 rows whatever the session's
  // dtype (widened here when it is not f32).
  Result<OffloadCompactKv> CompactFor(int layer, uint64_t session_id, int position) override;
  // For a selector whose replies are partial attention (attention): true for open sessions.
  bool ServesPartialAttention(uint64_t session_id) const override;
  // The attention output and log-sum-exp the cache rank computed for the decode token of
  // `session_id` at `position` in `layer` (this step's reply of the layer's pack); blocks until
  // it arrives (bounded like CompactFor); valid until the next LayerComputed.
  Result<OffloadPartial> PartialFor(int layer, uint64_t session_id, int position) override;

  int pack_layers() const { return pack_layers_; }
  DType kv_dtype() const { return session_shape_.dtype; }
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }
  // Seconds spent waiting for replies or sends that had not completed when the model needed
  // them (the `rubato:pack_wait_seconds` metric): the exposed wait. A transfer already done
  // when asked costs nothing; waits_blocked() counts the ones that were not.
  double pack_wait_seconds() const { return pack_wait_seconds_; }
  uint64_t waits_blocked() const { return waits_blocked_; }
  // Forward steps that offloaded K/V (each sends one KV pack per pack of layers).
  uint64_t steps() const { return step_; }
  bool delta_replies() const { return deltas_; }
  // What its sessions ask the cache rank for (CacheClientOptions::selection).
  const CacheSelectorSpec& selection() const { return options_.selection; }
  // Compact K / V rows (one row: one position of one KV head) the replies carried, and what
  // full replies would have carried for the same steps (equal without delta replies); the
  // bytes of those full replies (bytes_received() is what came).
  uint64_t compact_rows_received() const { return compact_rows_received_; }
  uint64_t compact_rows_full() const { return compact_rows_full_; }
  uint64_t full_reply_bytes() const { return full_reply_bytes_; }

  // Registers and from then on updates (docs/design.md §3): rubato:transport_bytes_total{role=
  // "inference", direction="tx"|"rx", backend} (KV packs out, replies in),
  // rubato:pack_wait_seconds (a histogram of each wait for a reply or a send) and
  // rubato:offload_steps_total (steps: bytes and wait per step are the ratios) and
  // rubato:compact_rows_total{reply="received"|"full"} (compact_rows_received / _full).
  // `registry` must outlive the client.
  Status RegisterMetrics(MetricsRegistry& registry);

 private:
  // A message buffer: 8-byte aligned storage for f32 / int32 sections.
  struct MessageBuffer {
    std::vector<uint64_t> words;
    std::span<std::byte> Bytes(uint64_t size);
  };
  // One reply pack of one step: its buffer, its receive, and the parsed view once it arrived.
  struct Reply {
    MessageBuffer buffer;
    uint64_t bytes = 0;
    transport::TransferId receive = 0;
    bool arrived = false;
    std::unique_ptr<LayerPackView> view;
    // A delta reply: `receive` is first its header's (kReplyHeaderTag), which says `bytes`;
    // no reply may be larger than `max_bytes` (every row entering).
    bool delta = false;
    bool header_arrived = false;
    uint64_t max_bytes = 0;
    MessageBuffer header;
  };
  struct StepReplies {
    uint64_t step = 0;
    std::vector<LayerPackRequest> requests;     // the step's request table
    std::vector<std::shared_ptr<Reply>> packs;  // [pack index]
  };
  // Where a session's latest reply is.
  struct SessionState {
    std::shared_ptr<StepReplies> replies;
    uint32_t request_index = 0;  // its entry in those replies' request table
    LayerPackRequest request;
    // Delta replies: the persistent compact pool of each layer, made at its first rows.
    std::vector<std::unique_ptr<CompactPool>> pools;  // [num_layers]
    int pool_capacity = 0;    // slots per pool: the most reply rows the session can ask for
    bool pools_empty = true;  // the next pack asks for a full reply (delta_reset)
    // One-token steps since the session's last prompt chunk (this step's included): the first
    // selection.dense_steps of them attend the local paged cache in full.
    int decode_steps = 0;
  };
  // The KV pack being filled / in flight, per pack index.
  struct OutgoingPack {
    MessageBuffer buffer;
    std::vector<transport::TransferId> sends;  // to finish before the buffer is rewritten
  };

  int PackOf(int layer) const { return layer / pack_layers_; }
  int PackFirstLayer(int pack) const { return pack * pack_layers_; }
  int PackLayers(int pack) const;
  // "layer 3" or "layers 4-7", for messages.
  static std::string LayerRange(int first, int count);
  // The header fields of pack `pack` of the current step (KV pack or its reply).
  LayerPackShape PackShape(LayerPackKind kind, int pack) const;
  Status StartStep(std::span<const OffloadLayerKv> entries);
  Status WritePackLayer(int layer, std::span<const OffloadLayerKv> entries);
  // `count` elements of `dtype` at `from` as the session's dtype at `to`.
  void WriteElements(DType dtype, const void* from, std::byte* to, size_t count);
  // The reply of this step's pack of `layer` for the decode token of `session_id` at
  // `position` (serves_same_step selectors): its view and request index, once arrived.
  Result<std::pair<const LayerPackView*, uint32_t>> SameStepReply(int layer, uint64_t session_id,
                                                                  int position);
  Status SendPack(int pack);
  Status AwaitReply(Reply& reply, uint64_t step, int pack);
  // ---- replies as posted, delta replies (cache_client_delta.cc) ----
  // Counts what pack `pack`'s full reply carries and posts the receive of its reply (of a delta
  // reply: of its header).
  Result<std::shared_ptr<Reply>> PostReplyReceive(int pack);
  // Waits for a delta reply's header, then posts the receive of the reply it announces.
  Status AwaitDeltaHeader(Reply& reply, const std::string& what);
  // Applies every (layer, request) of an arrived, validated delta reply to its session's pools.
  Status ApplyDeltaReply(const LayerPackView& reply);
  // The compact KV of a session's pool of `layer`, rows in ascending position order (the order a
  // full reply carries them, so attention over it is the full reply's bit for bit); checks
  // `slots` rows per head, all before `recent_begin`.
  Result<OffloadCompactKv> PoolCompactKv(uint64_t session_id, SessionState& session, int layer,
                                         int slots, int recent_begin);
  Status Wait(transport::TransferId id, const std::string& what);
  Status Broken(Status why);

  const CacheClientOptions options_;
  const ModelConfig model_;
  transport::Transport& transport_;
  const int cache_peer_;
  CacheSessionControl& control_;
  const CacheSelector* selector_ = nullptr;  // options_.selection's, never null
  int pack_layers_ = 1;
  int num_packs_ = 1;
  SessionShape session_shape_;

  uint64_t step_ = 0;
  std::vector<LayerPackRequest> step_requests_;  // [entries] of the current step
  std::shared_ptr<StepReplies> step_replies_;    // the current step's replies
  bool step_sent_ = false;                       // every pack of the current step went out
  bool deltas_ = false;  // delta replies (options_.delta_replies, a selector that replies rows)
  std::vector<OutgoingPack> outgoing_;       // [num_packs_]
  std::unique_ptr<LayerPackWriter> writer_;  // the pack being filled
  std::map<uint64_t, SessionState> sessions_;
  // Every reply whose receive may still be in flight, so that no buffer is freed under it.
  std::vector<std::shared_ptr<Reply>> inflight_;
  // CompactFor's rows widened to f32 (sessions not in f32), [kv_heads][slots][head_dim] each,
  // kept until the next LayerComputed.
  std::vector<std::vector<float>> widened_;
  std::vector<float> convert_;  // f32 staging of WriteElements

  Counter* steps_metric_ = nullptr;
  Counter* rows_received_metric_ = nullptr;  // rubato:compact_rows_total{reply}
  Counter* rows_full_metric_ = nullptr;
  std::vector<int> zero_counts_;  // [kv_heads] of 0: a pool-less session's counts

  Counter* tx_bytes_metric_ = nullptr;  // set by RegisterMetrics
  Counter* rx_bytes_metric_ = nullptr;
  Histogram* pack_wait_metric_ = nullptr;

  Status broken_;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
  double pack_wait_seconds_ = 0;
  uint64_t waits_blocked_ = 0;
  uint64_t compact_rows_received_ = 0;
  uint64_t compact_rows_full_ = 0;
  uint64_t full_reply_bytes_ = 0;
};

}  // namespace rubato
