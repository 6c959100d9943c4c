// cuda_util.h: the status check and device guard shared by the .cu files (nvcc only: includes the CUDA
// runtime header). Every CUDA call's status goes through check(), which raises kvstore::CudaError.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "pack_cuda.h"

namespace kvstore {

// Throws CudaError naming the call, the CUDA error name and its string. The failed call's status is also
// taken off the runtime's per-thread "last error", so a later cudaGetLastError() (after a kernel launch)
// does not report this old failure as its own.
inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw CudaError(std::string("kvstore CUDA error in ") + what + ": " + cudaGetErrorName(status) + ": " +
                    cudaGetErrorString(status));
  }
}

// Makes `device` current for the guard's lifetime and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);  // best effort: a destructor must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace kvstore
