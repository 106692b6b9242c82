// The data-plane protocol between an inference rank and a cache rank on top of the layer-pack
// format and a Transport: a fixed-size header, the KV pack, one reply per pack, each message of
// a size both sides know before it arrives (NCCL needs that), in order per (peer, tag). What a
// reply holds is the session's cache selector's rule. docs/disaggregated.md "The pack protocol".
#pragma once

#include <cstdint>

namespace rubato {

inline constexpr uint64_t kPackHeaderTag = 1;
inline constexpr uint64_t kPackTag = 2;
inline constexpr uint64_t kReplyTag = 3;
// A delta reply's size depends on the rows entering the pools, which only the cache rank knows:
// its 64-byte header goes first on this tag (as a KV pack's does on kPackHeaderTag), then the
// reply on kReplyTag. Full replies have no header message.
inline constexpr uint64_t kReplyHeaderTag = 4;

}  // namespace rubato
