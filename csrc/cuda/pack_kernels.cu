// pack_kernels.cu: one launch copies every (block, layer) page between the per-layer caches and the
// block-major packed buffer. Work is split into warp-sized pieces of a contiguous run; each lane keeps
// kUnroll vector loads in flight before storing, and a persistent grid (sized from the SM count and the
// kernel's occupancy) strides over the pieces.
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "cuda_util.h"
#include "pack_cuda.h"

namespace kvstore {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kUnroll = 8;  // vectors in flight per lane: 8 x 16 B = 128 B, 4 KiB per warp
constexpr int kMaxDevices = 64;

struct KernelArgs {
  PagePlan plan;
  const int64_t* layer_ptrs;
  const void* ids;
  int64_t num_ids;
  char* packed;
};

template <typename Vec>
__device__ __forceinline__ Vec load_stream(const Vec* p) { return __ldcs(p); }
template <typename Vec>
__device__ __forceinline__ void store_stream(Vec* p, const Vec& v) { __stcs(p, v); }

// Index is uint32_t when every piece number fits (nearly always: 2^32 pieces are 16 TiB), else int64_t;
// 32-bit division is several times cheaper, and it runs once per 4 KiB piece.
template <typename Vec, typename Id, typename Index, bool kGather>
__global__ void __launch_bounds__(kThreads) pages_kernel(const KernelArgs a) {
  const PagePlan& p = a.plan;
  const int lane = threadIdx.x % kWarpSize;
  const Index first = (static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x) / kWarpSize;
  const Index num_warps = static_cast<Index>(gridDim.x) * kThreads / kWarpSize;
  const Index vecs_per_run = static_cast<Index>(p.run_bytes / static_cast<int64_t>(sizeof(Vec)));
  constexpr Index kPieceVecs = kWarpSize * kUnroll;
  const Index pieces_per_run = (vecs_per_run + kPieceVecs - 1) / kPieceVecs;
  const Index num_layers = static_cast<Index>(p.num_layers);
  const Index total = static_cast<Index>(a.num_ids) * num_layers * static_cast<Index>(p.runs_per_item) *
                      pieces_per_run;

  for (Index w = first; w < total; w += num_warps) {
    const Index run = w / pieces_per_run;
    const Index piece = w - run * pieces_per_run;
    Index rest = run;
    int64_t offset = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {  // constant indices keep the plan out of local memory
      if (d < p.ndims) {
        const Index size = static_cast<Index>(p.sizes[d]);
        const Index q = rest / size;
        offset += static_cast<int64_t>(rest - q * size) * p.strides[d];
        rest = q;
      }
    }
    const Index sel = rest / num_layers;
    const Index layer = rest - sel * num_layers;
    const int64_t id = static_cast<const Id*>(a.ids)[sel];
    if (id < 0 || id >= p.num_cache_blocks) continue;  // never taken: ops.py rejects such ids first
    char* cache = reinterpret_cast<char*>(a.layer_ptrs[layer]) + id * p.block_stride + offset;
    char* packed = a.packed + static_cast<int64_t>(run) * p.run_bytes;
    const Vec* src = reinterpret_cast<const Vec*>(kGather ? cache : packed);
    Vec* dst = reinterpret_cast<Vec*>(kGather ? packed : cache);
    const Index v0 = piece * kPieceVecs + lane;
    Vec tmp[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (v0 + k * kWarpSize < vecs_per_run) tmp[k] = load_stream(src + v0 + k * kWarpSize);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (v0 + k * kWarpSize < vecs_per_run) store_stream(dst + v0 + k * kWarpSize, tmp[k]);
    }
  }
}

using KernelFn = void (*)(const KernelArgs);

template <typename Vec, typename Id, typename Index>
KernelFn pick_direction(bool gather) {
  return gather ? pages_kernel<Vec, Id, Index, true> : pages_kernel<Vec, Id, Index, false>;
}

template <typename Vec, typename Id>
KernelFn pick_index(bool small, bool gather) {
  return small ? pick_direction<Vec, Id, uint32_t>(gather) : pick_direction<Vec, Id, int64_t>(gather);
}

template <typename Vec>
KernelFn pick_ids(bool ids_int64, bool small, bool gather) {
  return ids_int64 ? pick_index<Vec, int64_t>(small, gather) : pick_index<Vec, int32_t>(small, gather);
}

KernelFn pick_kernel(int64_t vec_bytes, bool ids_int64, bool small, bool gather) {
  switch (vec_bytes) {
    case 16: return pick_ids<uint4>(ids_int64, small, gather);
    case 8: return pick_ids<uint2>(ids_int64, small, gather);
    case 4: return pick_ids<unsigned int>(ids_int64, small, gather);
    case 2: return pick_ids<unsigned short>(ids_int64, small, gather);
    default: return pick_ids<unsigned char>(ids_int64, small, gather);
  }
}

// Per-device launch facts, looked up once: multiprocessor count and resident blocks per SM. All kernel
// instantiations use a handful of registers and no shared memory, so the widest one's occupancy serves all.
struct DeviceFacts {
  int sms = 0;
  int blocks_per_sm = 0;
};

DeviceFacts device_facts(int device) {
  static std::array<std::atomic<int>, kMaxDevices> sms{};
  static std::array<std::atomic<int>, kMaxDevices> occupancy{};
  if (device < 0 || device >= kMaxDevices) {
    throw CudaError("kvstore CUDA: device index " + std::to_string(device) + " out of range [0, " +
                    std::to_string(kMaxDevices) + ")");
  }
  DeviceFacts facts{sms[device].load(), occupancy[device].load()};
  if (facts.sms > 0) return facts;
  DeviceGuard guard(device);
  check(cudaDeviceGetAttribute(&facts.sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&facts.blocks_per_sm, pages_kernel<uint4, int64_t, uint32_t, true>,
                                                      kThreads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  facts.blocks_per_sm = facts.blocks_per_sm > 0 ? facts.blocks_per_sm : 1;
  occupancy[device].store(facts.blocks_per_sm);
  sms[device].store(facts.sms);  // published last: a non-zero count means both are set
  return facts;
}

}  // namespace

int sm_count(int device) { return device_facts(device).sms; }

int64_t vector_bytes(const CudaPagesArgs& args) {
  return common_alignment(args.plan, args.layer_ptr_bits | static_cast<uint64_t>(args.packed));
}

void launch_pages(const CudaPagesArgs& args, bool gather) {
  const PagePlan& p = args.plan;
  if (args.num_ids <= 0 || p.item_bytes == 0) return;
  const int64_t vec = vector_bytes(args);
  const int64_t pieces_per_run = (p.run_bytes / vec + kWarpSize * kUnroll - 1) / (kWarpSize * kUnroll);
  const int64_t pieces = args.num_ids * p.num_layers * p.runs_per_item * pieces_per_run;
  const DeviceFacts facts = device_facts(args.device);
  constexpr int64_t kWarpsPerBlock = kThreads / kWarpSize;
  const int64_t wanted = (pieces + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t resident = static_cast<int64_t>(facts.sms) * facts.blocks_per_sm;
  const unsigned grid = static_cast<unsigned>(wanted < resident ? wanted : resident);
  // 32-bit indices when the last piece number plus one grid stride cannot wrap around.
  const bool small = pieces + static_cast<int64_t>(grid) * kWarpsPerBlock <= int64_t{UINT32_MAX};

  KernelArgs kargs{p, reinterpret_cast<const int64_t*>(args.layer_ptrs), reinterpret_cast<const void*>(args.ids),
                   args.num_ids, reinterpret_cast<char*>(args.packed)};
  DeviceGuard guard(args.device);
  pick_kernel(vec, args.ids_int64, small, gather)<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(args.stream)>>>(kargs);
  check(cudaGetLastError(), gather ? "gather_pages kernel launch" : "scatter_pages kernel launch");
}

}  // namespace kvstore
