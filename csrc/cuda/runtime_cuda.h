// runtime_cuda.h: the few CUDA runtime services the store's GPU data path needs, over raw addresses and
// stream handles (implemented in runtime_cuda.cu, bound in bindings_cuda.cpp). Plain C++ types only, so the
// binding compiles with the host compiler alone. Every function throws CudaError on a failed CUDA call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace kvstore {
namespace cudart {

constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

// Number of visible CUDA devices. Throws (with the driver's reason) when there is no driver or no device.
int device_count();
// "0000:3b:00.0"-style PCI bus id of a device, and the device ordinal in this process of such an id.
std::string pci_bus_id(int device);
int device_by_pci_bus_id(const std::string& bus_id);
// (free, total) bytes of device memory.
std::pair<size_t, size_t> mem_get_info(int device);

// Plain cudaMalloc / cudaFree on `device` (IPC handles can only be taken of such allocations).
uintptr_t device_malloc(int device, size_t nbytes);
void device_free(int device, uintptr_t ptr);

// CUDA IPC: the 64-byte handle of an allocation's base address; opening one exported by another process
// (mapped on `device`, peer access enabled lazily) and closing the mapping again.
std::string ipc_get_handle(int device, uintptr_t ptr);
uintptr_t ipc_open(int device, const std::string& handle);
void ipc_close(int device, uintptr_t ptr);

// Page-locks (and maps for every device) an existing host range, e.g. a shared-memory segment, so copies
// between it and device memory run as DMA; undone by host_unregister before the range is unmapped.
void host_register(uintptr_t ptr, size_t nbytes);
void host_unregister(uintptr_t ptr);

// cudaMemcpyAsync(cudaMemcpyDefault) enqueued on `stream` (a cudaStream_t as an integer, 0 = the legacy
// default stream) with `device` current; not waited for.
void memcpy_async(uintptr_t dst, uintptr_t src, size_t nbytes, int device, uintptr_t stream);
// A copy that has completed when the call returns (the daemon's device-to-host staging).
void memcpy_sync(uintptr_t dst, uintptr_t src, size_t nbytes, int device);

// Events without timing: create on `device`, record on a stream, wait for or poll, destroy.
uintptr_t event_create(int device);
void event_record(uintptr_t event, int device, uintptr_t stream);
void event_synchronize(uintptr_t event);
bool event_query(uintptr_t event);
void event_destroy(uintptr_t event);

// Enqueue a copy on `stream`, record an event after it and wait for that event: the copy and everything
// queued before it on the stream have finished when this returns (later work on the stream is not waited for).
void copy_and_wait(uintptr_t dst, uintptr_t src, size_t nbytes, int device, uintptr_t stream);

}  // namespace cudart
}  // namespace kvstore
