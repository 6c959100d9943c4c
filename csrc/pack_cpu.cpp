// pack_cpu.cpp: the kvstore._C extension. Gathers the pages of selected blocks from every layer's cache
// into one block-major buffer and scatters them back, with memcpy per contiguous run, in parallel over
// (block, layer) items when the work is large, with the GIL released.
//
// Inputs are raw addresses (Python ints), element strides and counts; kvstore/ops.py validates the tensors
// before calling, and the block ids are checked here (range; no repeats for scatter) before a byte moves.
//
// The *_xxh3 entries also return the xxh3-64 of the packed bytes, computed inside the copy: the packed side
// is hashed piece by piece (in packed order, so the streaming digest equals the one-shot digest of the whole
// buffer) right after a piece is written (gather) or while it is read (scatter), when it is still in cache.
// xxhash is not linked: libxxhash.so.0 (or $KVSTORE_XXHASH_LIB) is dlopen'ed at first use, so the extension
// imports where it is missing and xxh3_status() says why the fused entries are unavailable.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "page_plan.h"

namespace py = pybind11;

namespace kvstore {
namespace {

// Below this many bytes per thread, starting threads costs more than it saves: a start costs tens of
// microseconds, and on a busy machine a helper thread may wait a scheduler tick before it runs at all.
constexpr int64_t kMinBytesPerThread = int64_t{8} << 20;
// Unit of work a thread claims at a time.
constexpr int64_t kChunkBytes = int64_t{256} << 10;

// Copies of more than this many bytes in all (by default 3/4 of the last-level cache, as glibc does for one
// memcpy) cannot stay cached, so their stores bypass the cache: that saves reading every destination line
// before writing it (a third of the memory traffic of a copy).
int64_t streaming_threshold() {
  static const int64_t threshold = [] {
    long llc = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return llc > 0 ? static_cast<int64_t>(llc) * 3 / 4 : int64_t{8} << 20;
  }();
  return threshold;
}

// memcpy with non-temporal stores; the caller fences once after its last copy.
void copy_streaming(char* dst, const char* src, int64_t n) {
#if defined(__SSE2__)
  const int64_t head = std::min<int64_t>(n, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {  // one cache line per step, 4 loads before 4 stores
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
#endif
  std::memcpy(dst, src, n);
}

void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

struct Job {
  PagePlan plan;
  bool streaming = false;
  std::vector<uintptr_t> layers;
  const void* ids = nullptr;
  bool ids_int64 = true;
  int64_t num_ids = 0;
  char* packed = nullptr;
};

int64_t block_id(const Job& job, int64_t i) {
  return job.ids_int64 ? static_cast<const int64_t*>(job.ids)[i] : static_cast<const int32_t*>(job.ids)[i];
}

// The ids are checked here, before a byte moves, rather than in Python: once a large copy has evicted the
// CPU caches, reading them from Python costs ~100 us, more than this loop over thousands of ids.
void check_ids(const Job& job, bool unique) {
  const int64_t limit = job.plan.num_cache_blocks;
  std::vector<uint8_t> seen(unique ? static_cast<size_t>(limit) : 0);
  for (int64_t i = 0; i < job.num_ids; ++i) {
    const int64_t id = block_id(job, i);
    if (id < 0 || id >= limit) {
      throw py::value_error("block_ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                            " is out of range: expected 0 <= id < " + std::to_string(limit) +
                            " (blocks in each cache)");
    }
    if (unique && seen[id]++) {
      std::string where;
      for (int64_t j = 0; j <= i; ++j) {
        if (block_id(job, j) == id) where += (where.empty() ? "" : ", ") + std::to_string(j);
      }
      throw py::value_error("block_ids: expected distinct ids for scatter, got " + std::to_string(id) +
                            " at positions [" + where + "]");
    }
  }
}

char* item_cache(const Job& job, int64_t item) {
  const PagePlan& p = job.plan;
  return reinterpret_cast<char*>(job.layers[item % p.num_layers]) + block_id(job, item / p.num_layers) * p.block_stride;
}

// Odometer step from one run of an item to the next (runs are visited in packed order).
inline void next_run(const PagePlan& p, int64_t* idx, int64_t& offset) {
  for (int d = p.ndims - 1; d >= 0; --d) {
    offset += p.strides[d];
    if (++idx[d] < p.sizes[d]) return;
    offset -= p.strides[d] * p.sizes[d];
    idx[d] = 0;
  }
}

// Copies items [begin, end) where item = sel * num_layers + layer, visiting runs in packed order.
template <bool kGather, bool kStreaming>
void copy_items(const Job& job, int64_t begin, int64_t end) {
  const PagePlan& p = job.plan;
  char* packed = job.packed + begin * p.item_bytes;
  for (int64_t item = begin; item < end; ++item) {
    char* cache = item_cache(job, item);
    int64_t idx[kMaxDims] = {};
    int64_t offset = 0;
    for (int64_t r = 0; r < p.runs_per_item; ++r, next_run(p, idx, offset)) {
      char* dst = kGather ? packed : cache + offset;
      const char* src = kGather ? cache + offset : packed;
      if (kStreaming) {
        copy_streaming(dst, src, p.run_bytes);
      } else {
        std::memcpy(dst, src, p.run_bytes);
      }
      packed += p.run_bytes;
    }
  }
  if (kStreaming) store_fence();  // make the streamed stores visible before the thread reports done
}

template <bool kGather>
void copy_range(const Job& job, int64_t begin, int64_t end) {
  if (job.streaming) {
    copy_items<kGather, true>(job, begin, end);
  } else {
    copy_items<kGather, false>(job, begin, end);
  }
}

// streaming: 1 forces cache-bypassing stores, 0 forbids them, -1 decides by size.
template <bool kGather>
void run_job(Job& job, int64_t max_threads, int streaming) {
  check_ids(job, /*unique=*/!kGather);
  const int64_t items = job.num_ids * job.plan.num_layers;
  const int64_t total = items * job.plan.item_bytes;
  job.streaming = streaming < 0 ? total >= streaming_threshold() && job.plan.run_bytes >= 256 : streaming > 0;
  const int64_t threads = std::max<int64_t>(1, std::min({max_threads, total / kMinBytesPerThread, items}));
  if (threads == 1) {
    copy_range<kGather>(job, 0, items);
    return;
  }
  // Threads take chunks of ~kChunkBytes from a shared counter rather than fixed shares, so a thread that the
  // OS deschedules (a busy or shared machine) delays the call by one chunk, not by its whole share.
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, job.plan.item_bytes));
  std::atomic<int64_t> next{0};
  auto worker = [&job, &next, chunk, items] {
    for (int64_t begin = next.fetch_add(chunk); begin < items; begin = next.fetch_add(chunk)) {
      copy_range<kGather>(job, begin, std::min(begin + chunk, items));
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones running (and this one) share the rest
    }
  }
  worker();  // the calling thread works too
  for (auto& th : pool) th.join();
}


// ---- fused xxh3 ----------------------------------------------------------------------------------------
// The few entry points of xxhash 0.8's XXH3-64 streaming API, resolved from the shared library (the state is
// opaque: created and freed by the library itself, so its size and alignment never matter here).
struct Xxh3Api {
  void* (*create_state)() = nullptr;
  int (*free_state)(void*) = nullptr;
  int (*reset)(void*) = nullptr;
  int (*update)(void*, const void*, size_t) = nullptr;
  uint64_t (*digest)(const void*) = nullptr;
  std::string error;  // empty when usable
};

const Xxh3Api& xxh3_api() {
  static const Xxh3Api api = [] {
    Xxh3Api a;
    const char* env = std::getenv("KVSTORE_XXHASH_LIB");
    const std::string name = env != nullptr && *env != '\0' ? env : "libxxhash.so.0";
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      a.error = "cannot load " + name + ": " + (why != nullptr ? why : "unknown error");
      return a;
    }
    auto resolve = [&](const char* symbol, auto& fn) {
      void* p = dlsym(lib, symbol);
      if (p == nullptr && a.error.empty()) a.error = name + " has no symbol " + symbol;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    resolve("XXH3_createState", a.create_state);
    resolve("XXH3_freeState", a.free_state);
    resolve("XXH3_64bits_reset", a.reset);
    // The x86 build's runtime-dispatched update (AVX2/AVX-512) when the library has it: the plain entry is
    // compiled for SSE2 only (3x slower here). Same state, same digest.
    if (dlsym(lib, "XXH3_64bits_update_dispatch") != nullptr) {
      resolve("XXH3_64bits_update_dispatch", a.update);
    } else {
      resolve("XXH3_64bits_update", a.update);
    }
    resolve("XXH3_64bits_digest", a.digest);
    return a;  // the library stays loaded for the life of the process
  }();
  return api;
}

class Xxh3 {
 public:
  Xxh3() : api_(xxh3_api()) {
    if (!api_.error.empty()) throw std::runtime_error("fused checksums unavailable: " + api_.error);
    state_ = api_.create_state();
    if (state_ == nullptr) throw std::bad_alloc();
    api_.reset(state_);
  }
  ~Xxh3() { api_.free_state(state_); }
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void update(const char* p, int64_t n) { api_.update(state_, p, static_cast<size_t>(n)); }
  uint64_t digest() const { return api_.digest(state_); }

 private:
  const Xxh3Api& api_;
  void* state_ = nullptr;
};

// Workers may copy at most this far ahead of the hash, so the pieces they leave are still in the shared
// last-level cache when the hashing thread reads them.
constexpr int64_t kHashWindowBytes = int64_t{4} << 20;
// A fused copy hashes pieces of about this many bytes (whole items): small enough to stay in L2 between the copy
// and the hash.
constexpr int64_t kHashPieceBytes = int64_t{128} << 10;

// Feeds the runs of items [begin, end) to `hash` in packed order, read from the caches: the bytes a gather
// just wrote to the packed side, read again from where they are still cached when its stores bypassed the cache.
void hash_item_runs(const Job& job, int64_t begin, int64_t end, Xxh3& hash) {
  const PagePlan& p = job.plan;
  for (int64_t item = begin; item < end; ++item) {
    const char* cache = item_cache(job, item);
    int64_t idx[kMaxDims] = {};
    int64_t offset = 0;
    for (int64_t r = 0; r < p.runs_per_item; ++r, next_run(p, idx, offset)) hash.update(cache + offset, p.run_bytes);
  }
}

// Copies like run_job and returns the xxh3-64 of the packed bytes, a piece (~kChunkBytes of whole items) at a
// time. Gather hashes each piece right after copying it: the packed piece itself when its stores went through
// the cache, else the cache runs it was copied from (just read, so cached; same bytes, same packed order).
// Scatter hashes each packed piece before copying it, so the copy reads it from cache. The hash is sequential:
// with several threads, the calling thread hashes pieces in packed order while the others copy at most
// kHashWindowBytes ahead of it (it copies too whenever the next piece is not ready yet).
template <bool kGather>
uint64_t run_job_hashed(Job& job, int64_t max_threads, int streaming, int64_t piece_bytes) {
  Xxh3 hash;  // throws first when the library is missing
  check_ids(job, /*unique=*/!kGather);
  const PagePlan& p = job.plan;
  const int64_t items = job.num_ids * p.num_layers;
  const int64_t total = items * p.item_bytes;
  job.streaming = streaming < 0 ? total >= streaming_threshold() && p.run_bytes >= 256 : streaming > 0;
  if (piece_bytes <= 0) piece_bytes = kHashPieceBytes;
  const int64_t per_piece = std::max<int64_t>(1, piece_bytes / std::max<int64_t>(1, p.item_bytes));
  const int64_t pieces = (items + per_piece - 1) / per_piece;
  auto piece_size = [&](int64_t c) { return (std::min(items, (c + 1) * per_piece) - c * per_piece) * p.item_bytes; };
  auto piece_start = [&](int64_t c) { return job.packed + c * per_piece * p.item_bytes; };
  auto copy_piece = [&](int64_t c) { copy_range<kGather>(job, c * per_piece, std::min(items, (c + 1) * per_piece)); };
  auto hash_piece = [&](int64_t c) {
    if (kGather && job.streaming) {
      hash_item_runs(job, c * per_piece, std::min(items, (c + 1) * per_piece), hash);
    } else {
      hash.update(piece_start(c), piece_size(c));
    }
  };
  const int64_t threads = std::max<int64_t>(1, std::min({max_threads, total / kMinBytesPerThread, pieces}));
  if (threads == 1) {
    for (int64_t c = 0; c < pieces; ++c) {
      if (!kGather) hash_piece(c);  // read into cache, then copied from it
      copy_piece(c);
      if (kGather) hash_piece(c);  // just copied, still in cache
    }
    return hash.digest();
  }
  const int64_t window = std::max<int64_t>(2 * threads, kHashWindowBytes / (per_piece * p.item_bytes));
  std::unique_ptr<std::atomic<uint8_t>[]> done(new std::atomic<uint8_t>[pieces]);
  for (int64_t c = 0; c < pieces; ++c) done[c].store(0, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> hashed{0};
  auto worker = [&] {
    for (int64_t c = next.fetch_add(1); c < pieces; c = next.fetch_add(1)) {
      while (c >= hashed.load(std::memory_order_acquire) + window) std::this_thread::yield();
      copy_piece(c);
      done[c].store(1, std::memory_order_release);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  for (int64_t h = 0; h < pieces;) {
    if (done[h].load(std::memory_order_acquire)) {
      hash_piece(h);
      hashed.store(++h, std::memory_order_release);
      continue;
    }
    if (next.load(std::memory_order_relaxed) < pieces) {
      const int64_t c = next.fetch_add(1);
      if (c < pieces) {
        copy_piece(c);
        done[c].store(1, std::memory_order_release);
      }
      continue;
    }
    std::this_thread::yield();  // every piece is claimed; the next one is still being copied
  }
  for (auto& th : pool) th.join();
  return hash.digest();
}

std::string xxh3_status() { return xxh3_api().error; }

Job make_job(std::vector<uintptr_t> layers, uintptr_t ids, bool ids_int64, int64_t num_ids, int64_t num_cache_blocks,
             int64_t block_stride, const std::vector<int64_t>& dim_sizes, const std::vector<int64_t>& dim_strides,
             int64_t itemsize, uintptr_t packed) {
  if (layers.empty()) throw std::invalid_argument("layer_ptrs is empty");
  if (num_ids < 0) throw std::invalid_argument("num_ids must be >= 0, got " + std::to_string(num_ids));
  Job job;
  job.plan = make_plan(dim_sizes, dim_strides, itemsize, block_stride, static_cast<int64_t>(layers.size()),
                       num_cache_blocks);
  job.layers = std::move(layers);
  job.ids = reinterpret_cast<const void*>(ids);
  job.ids_int64 = ids_int64;
  job.num_ids = num_ids;
  job.packed = reinterpret_cast<char*>(packed);
  return job;
}

template <bool kGather>
void pages_entry(std::vector<uintptr_t> layer_ptrs, uintptr_t block_ids, bool ids_int64, int64_t num_ids,
                 int64_t num_cache_blocks, int64_t block_stride, const std::vector<int64_t>& dim_sizes,
                 const std::vector<int64_t>& dim_strides, int64_t itemsize, uintptr_t packed, int64_t num_threads,
                 int streaming) {
  Job job = make_job(std::move(layer_ptrs), block_ids, ids_int64, num_ids, num_cache_blocks, block_stride, dim_sizes,
                     dim_strides, itemsize, packed);
  if (num_threads <= 0) num_threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  run_job<kGather>(job, num_threads, streaming);
}

template <bool kGather>
uint64_t pages_entry_xxh3(std::vector<uintptr_t> layer_ptrs, uintptr_t block_ids, bool ids_int64, int64_t num_ids,
                          int64_t num_cache_blocks, int64_t block_stride, const std::vector<int64_t>& dim_sizes,
                          const std::vector<int64_t>& dim_strides, int64_t itemsize, uintptr_t packed,
                          int64_t num_threads, int streaming, int64_t piece_bytes) {
  Job job = make_job(std::move(layer_ptrs), block_ids, ids_int64, num_ids, num_cache_blocks, block_stride, dim_sizes,
                     dim_strides, itemsize, packed);
  if (num_threads <= 0) num_threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  return run_job_hashed<kGather>(job, num_threads, streaming, piece_bytes);
}

py::dict describe_plan(const std::vector<int64_t>& dim_sizes, const std::vector<int64_t>& dim_strides,
                       int64_t itemsize, int64_t block_stride, int64_t num_layers, int64_t num_cache_blocks) {
  const PagePlan p = make_plan(dim_sizes, dim_strides, itemsize, block_stride, num_layers, num_cache_blocks);
  py::dict d;
  d["run_bytes"] = p.run_bytes;
  d["runs_per_item"] = p.runs_per_item;
  d["item_bytes"] = p.item_bytes;
  d["sizes"] = std::vector<int64_t>(p.sizes, p.sizes + p.ndims);
  d["strides"] = std::vector<int64_t>(p.strides, p.strides + p.ndims);
  return d;
}

}  // namespace
}  // namespace kvstore

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvstore CPU kernels: gather/scatter of paged-KV blocks over raw pointers (no torch ABI).";
  const char* args_doc =
      "(layer_ptrs, block_ids, ids_int64, num_ids, num_cache_blocks, block_stride, dim_sizes, dim_strides, "
      "itemsize, packed, num_threads, streaming): addresses are ints; block_stride and dim_strides in elements; dims "
      "of one block in packed order; num_threads <= 0 means all cores; streaming 1/0 forces/forbids cache-bypassing "
      "stores, -1 uses them for copies larger than the last-level cache. Releases the GIL.";
  const auto gil = py::call_guard<py::gil_scoped_release>();
  m.def("gather_pages", &kvstore::pages_entry<true>, gil,
        (std::string("Copy the selected blocks of every layer into the block-major packed buffer ") + args_doc).c_str(),
        py::arg("layer_ptrs"), py::arg("block_ids"), py::arg("ids_int64"), py::arg("num_ids"),
        py::arg("num_cache_blocks"), py::arg("block_stride"), py::arg("dim_sizes"), py::arg("dim_strides"),
        py::arg("itemsize"), py::arg("packed"), py::arg("num_threads") = 0, py::arg("streaming") = -1);
  m.def("scatter_pages", &kvstore::pages_entry<false>, gil,
        (std::string("Copy the block-major packed buffer into the selected blocks of every layer ") + args_doc).c_str(),
        py::arg("layer_ptrs"), py::arg("block_ids"), py::arg("ids_int64"), py::arg("num_ids"),
        py::arg("num_cache_blocks"), py::arg("block_stride"), py::arg("dim_sizes"), py::arg("dim_strides"),
        py::arg("itemsize"), py::arg("packed"), py::arg("num_threads") = 0, py::arg("streaming") = -1);
  m.def("gather_pages_xxh3", &kvstore::pages_entry_xxh3<true>, gil,
        (std::string("As gather_pages, and return the xxh3-64 of the packed bytes, hashed as they are written ") +
         args_doc + " piece_bytes: hash granularity (<= 0: the default, 128 KiB). Raises RuntimeError when " +
         "xxh3_status() is not empty.").c_str(),
        py::arg("layer_ptrs"), py::arg("block_ids"), py::arg("ids_int64"), py::arg("num_ids"),
        py::arg("num_cache_blocks"), py::arg("block_stride"), py::arg("dim_sizes"), py::arg("dim_strides"),
        py::arg("itemsize"), py::arg("packed"), py::arg("num_threads") = 0, py::arg("streaming") = -1,
        py::arg("piece_bytes") = 0);
  m.def("scatter_pages_xxh3", &kvstore::pages_entry_xxh3<false>, gil,
        (std::string("As scatter_pages, and return the xxh3-64 of the packed source, hashed as it is read ") +
         args_doc + " piece_bytes: hash granularity (<= 0: the default, 128 KiB). Raises RuntimeError when " +
         "xxh3_status() is not empty.").c_str(),
        py::arg("layer_ptrs"), py::arg("block_ids"), py::arg("ids_int64"), py::arg("num_ids"),
        py::arg("num_cache_blocks"), py::arg("block_stride"), py::arg("dim_sizes"), py::arg("dim_strides"),
        py::arg("itemsize"), py::arg("packed"), py::arg("num_threads") = 0, py::arg("streaming") = -1,
        py::arg("piece_bytes") = 0);
  m.def("xxh3_status", &kvstore::xxh3_status,
        "Empty when the fused-checksum entries work; else why not (libxxhash.so.0 missing, or a symbol).");
  m.def("describe_plan", &kvstore::describe_plan, "The coalesced copy plan for one block (for tests and profiling).",
        py::arg("dim_sizes"), py::arg("dim_strides"), py::arg("itemsize"), py::arg("block_stride"),
        py::arg("num_layers"), py::arg("num_cache_blocks"));
}
