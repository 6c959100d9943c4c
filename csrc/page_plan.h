// page_plan.h: how one block of one layer is laid out in memory, reduced to a few loops of contiguous runs.
//
// Shared by the CPU (_C) and CUDA (_C_cuda) extensions. No torch, no pybind11, no CUDA: plain C++17, so the
// kernels stay independent of torch's ABI. All quantities a kernel sees are in bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvstore {

// Loop dimensions left after coalescing. A block of one layer has at most 4 logical dimensions
// (kv, token, head, dim); 6 leaves room for layouts with more.
constexpr int kMaxDims = 6;

// One block of one layer = `runs_per_item` contiguous runs of `run_bytes`, visited by an odometer over
// `sizes`/`strides` (outermost first). The packed side is dense in exactly that visiting order, so run r of
// item (sel, layer) lands at packed + ((sel * num_layers + layer) * runs_per_item + r) * run_bytes.
struct PagePlan {
  int64_t num_layers = 0;
  int64_t num_cache_blocks = 0;  // blocks in each layer's cache; ids outside [0, this) are never copied
  int64_t block_stride = 0;      // bytes between consecutive blocks of a layer's cache
  int32_t ndims = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // bytes
  int64_t run_bytes = 0;
  int64_t runs_per_item = 1;
  int64_t item_bytes = 0;          // bytes of one block of one layer
};

// Builds a plan from one block's dimensions in packed order (outermost first), with the cache's element
// strides for each. Dimensions of size 1 are dropped, and neighbours that are contiguous in the cache are
// merged, so a block in the layout's native order becomes one or two runs. Throws std::invalid_argument.
inline PagePlan make_plan(const std::vector<int64_t>& dim_sizes, const std::vector<int64_t>& dim_strides,
                          int64_t itemsize, int64_t block_stride, int64_t num_layers,
                          int64_t num_cache_blocks) {
  if (dim_sizes.size() != dim_strides.size()) {
    throw std::invalid_argument("dim_sizes has " + std::to_string(dim_sizes.size()) + " entries but dim_strides has " +
                                std::to_string(dim_strides.size()));
  }
  if (itemsize <= 0 || num_layers <= 0 || num_cache_blocks <= 0 || block_stride < 0) {
    throw std::invalid_argument("itemsize, num_layers and num_cache_blocks must be > 0 and block_stride >= 0");
  }
  std::vector<int64_t> sizes, strides;  // kept dims, outermost first
  for (size_t i = 0; i < dim_sizes.size(); ++i) {
    if (dim_sizes[i] <= 0 || dim_strides[i] < 0) {
      throw std::invalid_argument("dimension " + std::to_string(i) + " has size " + std::to_string(dim_sizes[i]) +
                                  " and stride " + std::to_string(dim_strides[i]) + "; expected size > 0, stride >= 0");
    }
    if (dim_sizes[i] == 1) continue;
    if (!sizes.empty() && strides.back() == dim_sizes[i] * dim_strides[i]) {
      sizes.back() *= dim_sizes[i];  // the previous (outer) dim steps exactly over this one: merge
      strides.back() = dim_strides[i];
      continue;
    }
    sizes.push_back(dim_sizes[i]);
    strides.push_back(dim_strides[i]);
  }
  PagePlan p;
  int64_t run_elems = 1;
  if (!sizes.empty() && strides.back() == 1) {  // the innermost dense dim becomes the run
    run_elems = sizes.back();
    sizes.pop_back();
    strides.pop_back();
  }
  if (sizes.size() > static_cast<size_t>(kMaxDims)) {
    throw std::invalid_argument("a block needs " + std::to_string(sizes.size()) + " loop dimensions, at most " +
                                std::to_string(kMaxDims) + " are supported");
  }
  p.num_layers = num_layers;
  p.num_cache_blocks = num_cache_blocks;
  p.block_stride = block_stride * itemsize;
  p.ndims = static_cast<int32_t>(sizes.size());
  for (int d = 0; d < p.ndims; ++d) {
    p.sizes[d] = sizes[d];
    p.strides[d] = strides[d] * itemsize;
    p.runs_per_item *= sizes[d];
  }
  p.run_bytes = run_elems * itemsize;
  p.item_bytes = p.run_bytes * p.runs_per_item;
  return p;
}

// Largest power of two <= 16 dividing every address and byte step the kernels touch; vector width for CUDA.
inline int64_t common_alignment(const PagePlan& p, uint64_t pointer_bits) {
  uint64_t bits = pointer_bits | static_cast<uint64_t>(p.run_bytes) | static_cast<uint64_t>(p.block_stride) | 16u;
  for (int d = 0; d < p.ndims; ++d) bits |= static_cast<uint64_t>(p.strides[d]);
  return static_cast<int64_t>(bits & (~bits + 1));  // lowest set bit
}

}  // namespace kvstore
