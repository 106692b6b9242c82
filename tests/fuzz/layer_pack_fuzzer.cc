// libFuzzer target: a data-plane message (KV pack or reply pack) through LayerPackView::Parse,
// then what a receiver does with an accepted one: every section of every (layer, request) is
// read whole (ASan reports a span past the input), a reply pack's counts and positions are
// checked by ValidateReplyContents, and each request is checked against a session of the pack's
// own shape by ValidateAgainstSession. Seeds: corpus/layer_pack.
#include <cstddef>
#include <cstdint>
#include <span>

#include "transport/layer_pack.h"

namespace {

// Sums the bytes so that the reads cannot be optimized away.
uint32_t Touch(std::span<const std::byte> section) {
  uint32_t sum = 0;
  for (const std::byte byte : section) sum += static_cast<uint32_t>(byte);
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto view = rubato::LayerPackView::Parse(bytes);
  if (!view.ok()) return 0;
  volatile uint32_t sink = 0;
  for (uint32_t layer = 0; layer < view->num_layers(); ++layer) {
    for (uint32_t request = 0; request < view->batch(); ++request) {
      sink = sink + Touch(view->Key(layer, request)) + Touch(view->Value(layer, request)) +
             Touch(view->Query(layer, request)) + Touch(view->Counts(layer, request)) +
             Touch(view->Positions(layer, request));
    }
  }
  if (view->kind() == rubato::LayerPackKind::kReplyPack) {
    static_cast<void>(rubato::ValidateReplyContents(*view));
  }
  rubato::SessionShape session;
  session.num_layers = view->first_layer() + view->num_layers();
  session.num_kv_heads = view->num_kv_heads();
  session.num_query_heads = view->num_query_heads();
  session.head_dim = view->head_dim();
  session.dtype = view->dtype();
  session.capacity_tokens = 1u << 20;
  for (uint32_t request = 0; request < view->batch(); ++request) {
    static_cast<void>(rubato::ValidateAgainstSession(*view, request, session));
  }
  return 0;
}
