// runtime_cuda.cu: host-only CUDA runtime calls for the store's GPU segments and the cuda_ipc transport
// (no kernels). Compiled by nvcc so that it sees the CUDA headers; see runtime_cuda.h for the contract.
#include <cuda_runtime.h>

#include <cstring>

#include "cuda_util.h"
#include "runtime_cuda.h"

namespace kvstore {
namespace cudart {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "cudaIpcMemHandle_t is not 64 bytes");

namespace {

void* as_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }
cudaStream_t as_stream(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
cudaEvent_t as_event(uintptr_t handle) { return reinterpret_cast<cudaEvent_t>(handle); }

// Destroys an event on every path out of copy_and_wait.
class ScopedEvent {
 public:
  explicit ScopedEvent(cudaEvent_t event) : event_(event) {}
  ~ScopedEvent() { cudaEventDestroy(event_); }
  ScopedEvent(const ScopedEvent&) = delete;
  ScopedEvent& operator=(const ScopedEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};

}  // namespace

int device_count() {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return count;
}

std::string pci_bus_id(int device) {
  char buf[32] = {0};
  check(cudaDeviceGetPCIBusId(buf, sizeof(buf), device), "cudaDeviceGetPCIBusId");
  return std::string(buf);
}

int device_by_pci_bus_id(const std::string& bus_id) {
  int device = -1;
  check(cudaDeviceGetByPCIBusId(&device, bus_id.c_str()), "cudaDeviceGetByPCIBusId");
  return device;
}

std::pair<size_t, size_t> mem_get_info(int device) {
  DeviceGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return {free_bytes, total_bytes};
}

uintptr_t device_malloc(int device, size_t nbytes) {
  DeviceGuard guard(device);
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, nbytes), "cudaMalloc");
  return reinterpret_cast<uintptr_t>(ptr);
}

void device_free(int device, uintptr_t ptr) {
  DeviceGuard guard(device);
  check(cudaFree(as_ptr(ptr)), "cudaFree");
}

std::string ipc_get_handle(int device, uintptr_t ptr) {
  DeviceGuard guard(device);
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, as_ptr(ptr)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uintptr_t ipc_open(int device, const std::string& handle) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    throw std::invalid_argument("a CUDA IPC memory handle is " + std::to_string(sizeof(cudaIpcMemHandle_t)) +
                                " bytes, got " + std::to_string(handle.size()));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  DeviceGuard guard(device);
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uintptr_t>(ptr);
}

void ipc_close(int device, uintptr_t ptr) {
  DeviceGuard guard(device);
  check(cudaIpcCloseMemHandle(as_ptr(ptr)), "cudaIpcCloseMemHandle");
}

void host_register(uintptr_t ptr, size_t nbytes) {
  check(cudaHostRegister(as_ptr(ptr), nbytes, cudaHostRegisterPortable), "cudaHostRegister");
}

void host_unregister(uintptr_t ptr) { check(cudaHostUnregister(as_ptr(ptr)), "cudaHostUnregister"); }

void memcpy_async(uintptr_t dst, uintptr_t src, size_t nbytes, int device, uintptr_t stream) {
  DeviceGuard guard(device);
  check(cudaMemcpyAsync(as_ptr(dst), as_ptr(src), nbytes, cudaMemcpyDefault, as_stream(stream)),
        "cudaMemcpyAsync");
}

void memcpy_sync(uintptr_t dst, uintptr_t src, size_t nbytes, int device) {
  DeviceGuard guard(device);
  check(cudaMemcpy(as_ptr(dst), as_ptr(src), nbytes, cudaMemcpyDefault), "cudaMemcpy");
}

uintptr_t event_create(int device) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return reinterpret_cast<uintptr_t>(event);
}

void event_record(uintptr_t event, int device, uintptr_t stream) {
  DeviceGuard guard(device);
  check(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
}

void event_synchronize(uintptr_t event) { check(cudaEventSynchronize(as_event(event)), "cudaEventSynchronize"); }

bool event_query(uintptr_t event) {
  const cudaError_t status = cudaEventQuery(as_event(event));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not a failure
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void event_destroy(uintptr_t event) { check(cudaEventDestroy(as_event(event)), "cudaEventDestroy"); }

void copy_and_wait(uintptr_t dst, uintptr_t src, size_t nbytes, int device, uintptr_t stream) {
  if (nbytes == 0) return;
  DeviceGuard guard(device);
  cudaEvent_t raw = nullptr;
  check(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  ScopedEvent event(raw);
  check(cudaMemcpyAsync(as_ptr(dst), as_ptr(src), nbytes, cudaMemcpyDefault, as_stream(stream)),
        "cudaMemcpyAsync");
  check(cudaEventRecord(event.get(), as_stream(stream)), "cudaEventRecord");
  check(cudaEventSynchronize(event.get()), "cudaEventSynchronize");
}

}  // namespace cudart
}  // namespace kvstore
