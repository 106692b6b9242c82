// The model half of a residency (docs/residency.md): what the model calls, per layer, for the
// forward entries whose KV a residency holds elsewhere than the paged cache, and the handle
// those entries carry. Each backend derives its own interface from ResidencyBackend
// (cpu_residency_backend.h, cuda_residency_backend.h); Model::SetResidencyBackend takes it, as
// it takes an attention policy's backend half. The model names no residency: it passes the
// handles on to the half that made them.
#pragma once

#include <string_view>

namespace rubato {

// One request's handle, set by its residency's engine half on the request's forward entries
// (ForwardEntry::residency) and read by the same residency's model half, which knows its type.
class ResidencyEntry {
 public:
  virtual ~ResidencyEntry() = default;
};

class ResidencyBackend {
 public:
  virtual ~ResidencyBackend() = default;
  virtual std::string_view backend_name() const = 0;    // the model's: "cpu" | "cuda"
  virtual std::string_view residency_name() const = 0;  // its table name (errors name it)
};

}  // namespace rubato
