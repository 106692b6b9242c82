// SFI's backend half on the CPU model (sfi_state.h): fast entries' compact segments from their
// state, and after each layer's dense attention of a slow entry the Selector's logits over J
// from its last W queries, the selection, and the gather into that layer's compact buffer. The
// reference runs the Selector in line, layer by layer; the CUDA half overlaps it.
#pragma once

#include <memory>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/policies/sfi/sfi_config.h"

namespace rubato {

Result<std::unique_ptr<AttentionBackend>> MakeSfiCpuBackend(const ModelConfig& model,
                                                            const SfiPolicyConfig& config);

}  // namespace rubato
