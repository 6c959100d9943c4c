// bindings_cuda.cpp: the kvstore._C_cuda extension (pybind11, compiled by the host compiler; the kernels
// come from pack_kernels.cu, linked with the static CUDA runtime). Loaded by kvstore/ops.py only when a
// CUDA tensor arrives. CUDA failures raise kvstore._C_cuda.CudaError (a RuntimeError).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "pack_cuda.h"
#include "runtime_cuda.h"

namespace py = pybind11;

namespace {

kvstore::CudaPagesArgs make_args(uintptr_t layer_ptrs, uint64_t layer_ptr_bits, int64_t num_layers, uintptr_t ids,
                                 bool ids_int64, int64_t num_ids, int64_t num_cache_blocks, int64_t block_stride,
                                 const std::vector<int64_t>& dim_sizes, const std::vector<int64_t>& dim_strides,
                                 int64_t itemsize, uintptr_t packed, int device, uintptr_t stream) {
  if (num_ids < 0) throw std::invalid_argument("num_ids must be >= 0, got " + std::to_string(num_ids));
  kvstore::CudaPagesArgs args;
  args.plan = kvstore::make_plan(dim_sizes, dim_strides, itemsize, block_stride, num_layers, num_cache_blocks);
  args.layer_ptrs = layer_ptrs;
  args.layer_ptr_bits = layer_ptr_bits;
  args.ids = ids;
  args.ids_int64 = ids_int64;
  args.num_ids = num_ids;
  args.packed = packed;
  args.device = device;
  args.stream = stream;
  return args;
}

template <bool kGather>
void pages_entry(uintptr_t layer_ptrs, uint64_t layer_ptr_bits, int64_t num_layers, uintptr_t ids, bool ids_int64,
                 int64_t num_ids, int64_t num_cache_blocks, int64_t block_stride, const std::vector<int64_t>& dim_sizes,
                 const std::vector<int64_t>& dim_strides, int64_t itemsize, uintptr_t packed, int device,
                 uintptr_t stream) {
  const auto args = make_args(layer_ptrs, layer_ptr_bits, num_layers, ids, ids_int64, num_ids, num_cache_blocks,
                              block_stride, dim_sizes, dim_strides, itemsize, packed, device, stream);
  kvstore::launch_pages(args, kGather);
}

int64_t vector_bytes_entry(uint64_t layer_ptr_bits, int64_t block_stride, const std::vector<int64_t>& dim_sizes,
                           const std::vector<int64_t>& dim_strides, int64_t itemsize, uintptr_t packed) {
  const auto args = make_args(0, layer_ptr_bits, 1, 0, true, 0, 1, block_stride, dim_sizes, dim_strides, itemsize,
                              packed, 0, 0);
  return kvstore::vector_bytes(args);
}

// The CUDA runtime services of runtime_cuda.h (GPU segments, CUDA IPC, pinned shared memory, copies on a
// caller's stream). Addresses, streams and events are plain integers; IPC handles are 64-byte `bytes`.
void bind_runtime(py::module_& m) {
  namespace rt = kvstore::cudart;
  const auto gil = py::call_guard<py::gil_scoped_release>();
  m.def("device_count", &rt::device_count, gil, "Visible CUDA devices; CudaError when no driver or device.");
  m.def("pci_bus_id", &rt::pci_bus_id, gil, "PCI bus id of a device.", py::arg("device"));
  m.def("device_by_pci_bus_id", &rt::device_by_pci_bus_id, gil, "Device ordinal (in this process) of a PCI bus id.",
        py::arg("bus_id"));
  m.def("mem_get_info", &rt::mem_get_info, gil, "(free, total) bytes of a device's memory.", py::arg("device"));
  m.def("device_malloc", &rt::device_malloc, gil, "cudaMalloc on a device; returns the address.", py::arg("device"),
        py::arg("nbytes"));
  m.def("device_free", &rt::device_free, gil, "cudaFree of an address from device_malloc.", py::arg("device"),
        py::arg("ptr"));
  m.def(
      "ipc_get_handle",
      [](int device, uintptr_t ptr) {
        std::string handle;
        {
          py::gil_scoped_release release;
          handle = rt::ipc_get_handle(device, ptr);
        }
        return py::bytes(handle);
      },
      "The 64-byte CUDA IPC handle of an allocation's base address.", py::arg("device"), py::arg("ptr"));
  m.def("ipc_open", &rt::ipc_open, gil, "Map another process's allocation by its IPC handle; returns the address.",
        py::arg("device"), py::arg("handle"));
  m.def("ipc_close", &rt::ipc_close, gil, "Unmap an address returned by ipc_open.", py::arg("device"), py::arg("ptr"));
  m.def("host_register", &rt::host_register, gil, "cudaHostRegister (portable) of a host range.", py::arg("ptr"),
        py::arg("nbytes"));
  m.def("host_unregister", &rt::host_unregister, gil, "cudaHostUnregister of a registered range.", py::arg("ptr"));
  m.def("memcpy_async", &rt::memcpy_async, gil, "Enqueue cudaMemcpyAsync(cudaMemcpyDefault) on a stream.",
        py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"), py::arg("stream"));
  m.def("memcpy_sync", &rt::memcpy_sync, gil, "cudaMemcpy(cudaMemcpyDefault), complete on return.", py::arg("dst"),
        py::arg("src"), py::arg("nbytes"), py::arg("device"));
  m.def("event_create", &rt::event_create, gil, "A CUDA event without timing on a device.", py::arg("device"));
  m.def("event_record", &rt::event_record, gil, "Record an event on a stream.", py::arg("event"), py::arg("device"),
        py::arg("stream"));
  m.def("event_synchronize", &rt::event_synchronize, gil, "Wait for an event.", py::arg("event"));
  m.def("event_query", &rt::event_query, gil, "True when an event has completed.", py::arg("event"));
  m.def("event_destroy", &rt::event_destroy, gil, "Destroy an event.", py::arg("event"));
  m.def("copy_and_wait", &rt::copy_and_wait, gil,
        "Enqueue a copy on a stream, record an event after it and wait for that event.", py::arg("dst"), py::arg("src"),
        py::arg("nbytes"), py::arg("device"), py::arg("stream"));
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "kvstore CUDA kernels: one-launch gather/scatter of paged-KV blocks over raw device pointers.";
  py::register_exception<kvstore::CudaError>(m, "CudaError", PyExc_RuntimeError);
  const char* args_doc =
      "(layer_ptrs, layer_ptr_bits, num_layers, block_ids, ids_int64, num_ids, num_cache_blocks, block_stride, "
      "dim_sizes, dim_strides, itemsize, packed, device, stream): layer_ptrs is the device address of an int64 "
      "array of layer base addresses and layer_ptr_bits the OR of those addresses; strides in elements; the "
      "kernel is enqueued on `stream` (a cudaStream_t as int) and not waited for.";
  const auto gil = py::call_guard<py::gil_scoped_release>();
  m.def("gather_pages", &pages_entry<true>, gil,
        (std::string("Enqueue the copy of the selected blocks of every layer into the packed buffer ") + args_doc)
            .c_str(),
        py::arg("layer_ptrs"), py::arg("layer_ptr_bits"), py::arg("num_layers"), py::arg("block_ids"),
        py::arg("ids_int64"), py::arg("num_ids"), py::arg("num_cache_blocks"), py::arg("block_stride"),
        py::arg("dim_sizes"), py::arg("dim_strides"), py::arg("itemsize"), py::arg("packed"), py::arg("device"),
        py::arg("stream"));
  m.def("scatter_pages", &pages_entry<false>, gil,
        (std::string("Enqueue the copy of the packed buffer into the selected blocks of every layer ") + args_doc)
            .c_str(),
        py::arg("layer_ptrs"), py::arg("layer_ptr_bits"), py::arg("num_layers"), py::arg("block_ids"),
        py::arg("ids_int64"), py::arg("num_ids"), py::arg("num_cache_blocks"), py::arg("block_stride"),
        py::arg("dim_sizes"), py::arg("dim_strides"), py::arg("itemsize"), py::arg("packed"), py::arg("device"),
        py::arg("stream"));
  m.def("sm_count", &kvstore::sm_count, gil, "Multiprocessor count of a CUDA device.", py::arg("device"));
  bind_runtime(m);
  m.def("vector_bytes", &vector_bytes_entry,
        "Width in bytes of the vector loads/stores a launch with these addresses and strides would use.",
        py::arg("layer_ptr_bits"), py::arg("block_stride"), py::arg("dim_sizes"), py::arg("dim_strides"),
        py::arg("itemsize"), py::arg("packed"));
}
