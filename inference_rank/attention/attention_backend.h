// The backend half of an attention policy: its device state (pools, rings), its kernels and the
// work it adds around each layer's attention, for one model. Each backend derives its own
// interface from this (cpu_backend.h, cuda_backend.h); Model::SetAttentionBackend takes it.
#pragma once

#include <string_view>

namespace rubato {

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string_view backend_name() const = 0;  // the model's: "cpu" | "cuda"
};

}  // namespace rubato
