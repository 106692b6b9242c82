// Capture and replay of decode-step CUDA graphs (cuda_decode_graph.h).
#include "inference_rank/model/cuda_decode_graph.h"

#include <string>

#include "common/logging.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato {

Status DecodeGraphCache::Run(const DecodeGraphKey& key, cudaStream_t stream,
                             const std::function<Status(cudaStream_t)>& enqueue) {
  if (disabled_) return enqueue(stream);
  auto [it, inserted] = graphs_.try_emplace(key);
  Entry& entry = it->second;
  entry.last_use = ++clock_;
  if (inserted) {  // first sight: eager
    DropLeastRecentlyUsed();
    return enqueue(stream);
  }
  if (entry.exec == nullptr) {
    const Status captured = Capture(entry, stream, enqueue);
    if (!captured.ok()) return captured;
    if (disabled_) return enqueue(stream);
  }
  ++replays_;
  return cuda::CudaStatus(cudaGraphLaunch(entry.exec, stream), "launching a decode-step graph");
}

Status DecodeGraphCache::Capture(Entry& entry, cudaStream_t stream,
                                 const std::function<Status(cudaStream_t)>& enqueue) {
  // Thread-local mode: other threads' CUDA calls (another model, a test's helper) neither break
  // this capture nor get caught in it.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                              "starting a decode-step graph capture");
  const Status enqueued = enqueue(stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  cudaGraphExec_t exec = nullptr;
  cudaError_t instantiated = cudaErrorUnknown;
  if (enqueued.ok() && ended == cudaSuccess) {
    // Per-node priorities: a branch forked onto a low-priority stream (an attention backend's
    // side work) keeps its stream's priority.
    instantiated = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!enqueued.ok()) {
    cudaGetLastError();  // a launch error inside the capture may also have invalidated it
    return enqueued.WithContext("capturing a decode-step graph");
  }
  if (ended != cudaSuccess || instantiated != cudaSuccess) {
    const Status why = cuda::CudaStatus(ended != cudaSuccess ? ended : instantiated,
                                        "capturing a decode-step graph");
    cudaGetLastError();
    RUBATO_LOG_WARN("model", "{}; CUDA graphs are off for this model from now on", why.message());
    disabled_ = true;
    Clear();
    return Status::Ok();
  }
  entry.exec = exec;
  ++captures_;
  return Status::Ok();
}

void DecodeGraphCache::DropLeastRecentlyUsed() {
  while (static_cast<int>(graphs_.size()) > max_graphs_) {
    auto oldest = graphs_.begin();
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
      if (it->second.last_use < oldest->second.last_use) oldest = it;
    }
    if (oldest->second.exec != nullptr) cudaGraphExecDestroy(oldest->second.exec);
    graphs_.erase(oldest);
  }
}

void DecodeGraphCache::Clear() {
  for (auto& [key, entry] : graphs_) {
    if (entry.exec != nullptr) cudaGraphExecDestroy(entry.exec);
  }
  graphs_.clear();
}

}  // namespace rubato
