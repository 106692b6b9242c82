// Helpers shared by the kernel benchmarks (attention_kascade.cc, attention_longflow.cc): the
// median time of a launch over CUDA-event pairs, host vectors uploaded to device buffers, the
// command line and the JSON report's file.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato::bench {

// Median ms of `launch` over `iterations` timed runs after `warmup` untimed ones (one launch per
// CUDA-event pair on the default stream).
inline Result<double> MedianLaunchMs(const std::function<Status()>& launch, int warmup,
                                     int iterations) {
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "event");
  std::vector<double> ms;
  Status status;
  for (int i = 0; i < warmup + iterations && status.ok(); ++i) {
    cudaEventRecord(start);
    status = launch();
    cudaEventRecord(stop);
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timed launch");
    float elapsed = 0;
    cudaEventElapsedTime(&elapsed, start, stop);
    if (i >= warmup) ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  if (ms.empty()) return InvalidArgumentError("no timed iterations");
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <typename T>
Result<cuda::DeviceBuffer<T>> Upload(const std::vector<T>& host, const char* what) {
  RUBATO_ASSIGN_OR_RETURN(auto buffer, cuda::DeviceBuffer<T>::Allocate(host.size(), what));
  RUBATO_RETURN_IF_ERROR(buffer.CopyFromHost(host.data(), host.size(), nullptr));
  return buffer;
}

// "argv[0] argv[1] ...": the command recorded in a report.
inline std::string CommandLine(int argc, char** argv) {
  std::string command = argc > 0 ? argv[0] : "";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return command;
}

// Writes `report` as indented JSON to `path` ("" writes nothing); IoError naming the path.
inline Status WriteJsonReport(const nlohmann::json& report, const std::string& path) {
  if (path.empty()) return Status::Ok();
  std::ofstream file(path);
  file << report.dump(2) << "\n";
  if (!file) return IoError("cannot write " + path);
  return Status::Ok();
}

// Runs `run(value, point)` for each of `values`, appending each point to report["points"]; a
// point that fails (one that does not fit the card included) is reported as {key: value, error},
// not dropped. Then writes the report to `out`. The program's exit status: 1 when the report
// cannot be written or a point failed otherwise than kResourceExhausted, else 0.
inline int RunPoints(nlohmann::json& report, const char* key, const std::vector<int>& values,
                     const std::function<Status(int, nlohmann::json&)>& run, const std::string& out,
                     const char* program) {
  int failed = 0;
  for (int value : values) {
    nlohmann::json point;
    const Status status = run(value, point);
    if (!status.ok()) {
      std::printf("%s %d: %s\n", key, value, status.ToString().c_str());
      point = {{key, value}, {"error", status.ToString()}};
      failed += status.code() == StatusCode::kResourceExhausted ? 0 : 1;
    }
    report["points"].push_back(point);
  }
  const Status written = WriteJsonReport(report, out);
  if (!written.ok()) {
    std::fprintf(stderr, "%s: error: %s\n", program, written.message().c_str());
    return 1;
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace rubato::bench
