// The pool of SFI compact buffers on the CUDA model's device and its slot handles
// (cuda_sfi_pool.h).
#include "inference_rank/policies/sfi/cuda_sfi_pool.h"

#include <string>
#include <utility>

namespace rubato {

// The free slots. Held by the pool and by every handle: a handle destroyed after the pool (a
// state that outlives its model) returns its slot to a list nobody reads any more.
class CudaSfiPool::FreeList {
 public:
  explicit FreeList(int slots) {
    for (int slot = slots - 1; slot >= 0; --slot) free_.push_back(slot);  // 0 comes out first
  }
  bool empty() const { return free_.empty(); }
  int Take() {
    const int slot = free_.back();
    free_.pop_back();
    return slot;
  }
  void Give(int slot) { free_.push_back(slot); }
  int free() const { return static_cast<int>(free_.size()); }

 private:
  std::vector<int> free_;
};

class CudaSfiPool::Handle final : public SfiBackendHandle {
 public:
  Handle(std::shared_ptr<FreeList> owner, int slot) : owner_(std::move(owner)), slot_(slot) {}
  ~Handle() override { owner_->Give(slot_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  const FreeList* owner() const { return owner_.get(); }
  int slot() const { return slot_; }

 private:
  std::shared_ptr<FreeList> owner_;
  int slot_;
};

size_t CudaSfiPoolShape::Bytes() const {
  const size_t rows = static_cast<size_t>(num_layers) * slots * num_kv_heads * capacity;
  const size_t pairs = static_cast<size_t>(num_layers) * slots * num_kv_heads;
  const size_t guard = static_cast<size_t>(num_layers) * slots * guard_query_dim * sizeof(float) +
                       (guard_query_dim > 0 ? slots * sizeof(float) : 0);
  return 2 * rows * head_dim * sizeof(__nv_bfloat16) + rows * sizeof(int32_t) +
         pairs * sizeof(int32_t) + guard;
}

CudaSfiPool::CudaSfiPool(const CudaSfiPoolShape& shape)
    : shape_(shape), free_list_(std::make_shared<FreeList>(shape.slots)) {}

CudaSfiPool::~CudaSfiPool() = default;

Result<std::unique_ptr<CudaSfiPool>> CudaSfiPool::Create(const CudaSfiPoolShape& shape) {
  if (shape.num_layers < 1 || shape.num_kv_heads < 1 || shape.head_dim < 1 || shape.capacity < 1 ||
      shape.slots < 1 || shape.guard_query_dim < 0) {
    return InvalidArgumentError(
        "SFI compact pool: every dimension must be >= 1, the guard's >= 0 (layers " +
        std::to_string(shape.num_layers) + ", KV heads " + std::to_string(shape.num_kv_heads) +
        ", head_dim " + std::to_string(shape.head_dim) + ", capacity " +
        std::to_string(shape.capacity) + ", slots " + std::to_string(shape.slots) +
        ", guard query dim " + std::to_string(shape.guard_query_dim) + ")");
  }
  std::unique_ptr<CudaSfiPool> pool(new CudaSfiPool(shape));
  const size_t rows = static_cast<size_t>(shape.num_layers) * pool->LayerRows();
  const size_t pairs = static_cast<size_t>(shape.num_layers) * shape.slots * shape.num_kv_heads;
  const std::string what = "the SFI compact pool (" + std::to_string(shape.slots) + " requests x " +
                           std::to_string(shape.num_layers) + " layers x " +
                           std::to_string(shape.num_kv_heads) + " KV heads x " +
                           std::to_string(shape.capacity) + " rows, " +
                           std::to_string(shape.Bytes()) + " bytes in all): ";
  auto allocate = [&]<typename Element>(cuda::DeviceBuffer<Element>& buffer, size_t count,
                                        const char* name) -> Status {
    Result<cuda::DeviceBuffer<Element>> allocated =
        cuda::DeviceBuffer<Element>::Allocate(count, what + name);
    if (!allocated.ok()) return allocated.status();
    buffer = std::move(allocated).value();
    return Status::Ok();
  };
  RUBATO_RETURN_IF_ERROR(allocate(pool->keys_, rows * shape.head_dim, "keys"));
  RUBATO_RETURN_IF_ERROR(allocate(pool->values_, rows * shape.head_dim, "values"));
  RUBATO_RETURN_IF_ERROR(allocate(pool->counts_, pairs, "counts"));
  RUBATO_RETURN_IF_ERROR(allocate(pool->positions_, rows, "positions"));
  if (shape.guard_query_dim > 0) {
    const size_t references =
        static_cast<size_t>(shape.num_layers) * shape.slots * shape.guard_query_dim;
    RUBATO_RETURN_IF_ERROR(allocate(pool->guard_references_, references, "guard references"));
    RUBATO_RETURN_IF_ERROR(allocate(pool->guard_cosine_sums_, shape.slots, "guard cosine sums"));
  }
  return pool;
}

int CudaSfiPool::SlotOf(const SfiSequenceState& state) const {
  const auto* handle = dynamic_cast<const Handle*>(state.backend.get());
  return handle != nullptr && handle->owner() == free_list_.get() ? handle->slot() : -1;
}

Result<int> CudaSfiPool::AcquireFor(SfiSequenceState& state) {
  const int held = SlotOf(state);
  if (held >= 0) return held;
  if (free_list_->empty()) {
    return ResourceExhaustedError(
        "SFI: all " + std::to_string(shape_.slots) +
        " compact-pool slots are held by running requests (MakeSfiCudaBackend sized the pool for " +
        std::to_string(shape_.slots) + "; the engine passes engine.max_batch)");
  }
  const int slot = free_list_->Take();
  state.backend = std::make_unique<Handle>(free_list_, slot);  // drops another pool's handle
  return slot;
}

int CudaSfiPool::slots_in_use() const { return shape_.slots - free_list_->free(); }

}  // namespace rubato
