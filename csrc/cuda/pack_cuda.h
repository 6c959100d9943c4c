// pack_cuda.h: host entry points of the CUDA page kernels (implemented in pack_kernels.cu, bound to Python
// in bindings_cuda.cpp). Plain C++ types only, so the binding compiles with the host compiler alone.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../page_plan.h"

namespace kvstore {

// A failed CUDA call; what() holds the call, the CUDA error name and its error string.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CudaPagesArgs {
  PagePlan plan;
  uintptr_t layer_ptrs = 0;     // device array of num_layers int64 base addresses
  uint64_t layer_ptr_bits = 0;  // OR of all layer base addresses (for the vector-width choice)
  uintptr_t ids = 0;            // device array of num_ids block ids
  bool ids_int64 = true;
  int64_t num_ids = 0;
  uintptr_t packed = 0;         // device address of the packed buffer
  int device = 0;
  uintptr_t stream = 0;         // cudaStream_t of the caller's current stream
};

// Enqueues one kernel for all layers and blocks on args.stream. Throws CudaError.
void launch_pages(const CudaPagesArgs& args, bool gather);

// Multiprocessor count of a device (cached). Throws CudaError.
int sm_count(int device);

// Width in bytes of the vector loads/stores a launch with these arguments uses.
int64_t vector_bytes(const CudaPagesArgs& args);

}  // namespace kvstore
