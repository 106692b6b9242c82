// A Model that forwards every call to another one and times its Forward calls, in wall time and
// in the calling thread's CPU time: bench/host_path.cc reads the gaps between consecutive
// Forwards (what the layers above the model do between two steps, on the thread that steps).
// The wrapped model is borrowed (one loaded model serves many engines, one after the other).
#pragma once

#include <time.h>

#include <chrono>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "inference_rank/model/model.h"

namespace rubato {

class TimedModel : public Model {
 public:
  explicit TimedModel(Model& inner) : inner_(&inner) {}

  const ModelConfig& config() const override { return inner_->config(); }
  std::string_view backend_name() const override { return inner_->backend_name(); }
  size_t weight_bytes() const override { return inner_->weight_bytes(); }
  Result<std::unique_ptr<PagedKvCache>> CreateKvCache(int block_tokens, int num_blocks) override {
    return inner_->CreateKvCache(block_tokens, num_blocks);
  }
  Result<KvPoolMemory> KvPoolMemoryFor(int block_tokens, const StepBounds& bounds) const override {
    return inner_->KvPoolMemoryFor(block_tokens, bounds);
  }
  Result<std::unique_ptr<SlotKvPool>> CreateSlotKvPool(int budget, int num_arrays) override {
    return inner_->CreateSlotKvPool(budget, num_arrays);
  }
  Status Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache, ForwardResult& result,
                 const AttentionWindow& window = AttentionWindow()) override {
    const double wall_start = WallSeconds(), cpu_start = ThreadCpuSeconds();
    if (forwards_ > 0) {
      wall_gaps_.push_back(wall_start - wall_end_);
      cpu_gaps_.push_back(cpu_start - cpu_end_);
    }
    Status status = inner_->Forward(batch, cache, result, window);
    wall_end_ = WallSeconds();
    cpu_end_ = ThreadCpuSeconds();
    forward_seconds_ += wall_end_ - wall_start;
    forward_cpu_seconds_ += cpu_end_ - cpu_start;
    if (forwards_ == 0) first_start_ = wall_start;
    ++forwards_;
    return status;
  }
  void SetNumThreads(int num_threads) override { inner_->SetNumThreads(num_threads); }
  Status SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) override {
    return inner_->SetAttentionBackend(std::move(backend));
  }
  AttentionBackend* attention_backend() override { return inner_->attention_backend(); }
  Status SetResidencyBackend(std::unique_ptr<ResidencyBackend> backend) override {
    return inner_->SetResidencyBackend(std::move(backend));
  }
  ResidencyBackend* residency_backend() const override { return inner_->residency_backend(); }

  double forward_seconds() const { return forward_seconds_; }  // summed over Forward calls
  double forward_cpu_seconds() const { return forward_cpu_seconds_; }
  int64_t forwards() const { return forwards_; }
  // Between Forward i - 1's return and Forward i's call (i >= 1): wall seconds, and seconds of
  // CPU of the thread that steps.
  const std::vector<double>& wall_gaps() const { return wall_gaps_; }
  const std::vector<double>& cpu_gaps() const { return cpu_gaps_; }
  double first_start() const { return first_start_; }  // WallSeconds() at the first Forward
  double last_end() const { return wall_end_; }        // and at the last one's return

  static double WallSeconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  static double ThreadCpuSeconds() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }

 private:
  Model* inner_;
  double forward_seconds_ = 0, forward_cpu_seconds_ = 0;
  int64_t forwards_ = 0;
  double first_start_ = 0, wall_end_ = 0, cpu_end_ = 0;
  std::vector<double> wall_gaps_, cpu_gaps_;
};

}  // namespace rubato
