#include "memory/shareable_allocation.hpp"

#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace deep_ep {
namespace {

// The driver functions this file uses, resolved once through the runtime.
struct DriverApi {
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long) = nullptr;
  CUresult (*mem_export)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long) = nullptr;
  CUresult (*mem_import)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*mem_granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  bool complete = false;
};

template <typename Function>
bool resolve(const char* symbol, Function& function) {
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &pointer, 12000, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess || pointer == nullptr) {
    cudaGetLastError();  // not sticky, but keep the runtime's last error clean
    return false;
  }
  function = reinterpret_cast<Function>(pointer);
  return true;
}

const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi table;
    table.complete =
        resolve("cuGetErrorString", table.get_error_string) &&
        resolve("cuDeviceGetAttribute", table.device_get_attribute) && resolve("cuMemCreate", table.mem_create) &&
        resolve("cuMemExportToShareableHandle", table.mem_export) &&
        resolve("cuMemImportFromShareableHandle", table.mem_import) &&
        resolve("cuMemGetAllocationGranularity", table.mem_granularity) &&
        resolve("cuMemAddressReserve", table.address_reserve) && resolve("cuMemAddressFree", table.address_free) &&
        resolve("cuMemMap", table.mem_map) && resolve("cuMemUnmap", table.mem_unmap) &&
        resolve("cuMemSetAccess", table.mem_set_access) && resolve("cuMemRelease", table.mem_release);
    return table;
  }();
  return api;
}

void check(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return;
  const char* text = "unknown error";
  if (driver().get_error_string != nullptr) driver().get_error_string(status, &text);
  throw std::runtime_error(std::string(call) + " failed: " + text);
}

CUmemAllocationProp allocation_properties(int device) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// pidfd_getfd(2): a duplicate of descriptor `fd` of process `pid` (needs the same ptrace access as
// attaching a debugger: same user, or root).
int duplicate_descriptor(int pid, int fd) {
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    throw std::runtime_error("pidfd_open(" + std::to_string(pid) + ") failed: " + std::strerror(errno) +
                             " (the peer process is gone, or this kernel is older than 5.6)");
  }
  const int local = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int error = errno;
  close(pidfd);
  if (local < 0) {
    throw std::runtime_error("pidfd_getfd(pid " + std::to_string(pid) + ", fd " + std::to_string(fd) +
                             ") failed: " + std::strerror(error) +
                             " (ranks must be allowed to ptrace each other; EP_IPC_MEMORY=legacy uses CUDA IPC "
                             "handles instead, whose windows die with their process)");
  }
  return local;
}

}  // namespace

bool ShareableAllocation::supported(int device) {
  const char* forced = std::getenv("EP_IPC_MEMORY");
  if (forced != nullptr && std::string(forced) == "legacy") return false;
  const DriverApi& api = driver();
  if (!api.complete) return false;
  int vmm = 0;
  int posix_fd = 0;
  if (api.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) != CUDA_SUCCESS ||
      api.device_get_attribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device) !=
          CUDA_SUCCESS) {
    return false;
  }
  return vmm != 0 && posix_fd != 0;
}

ShareableAllocation::~ShareableAllocation() {
  try {
    release();
  } catch (...) {
    // Destructors must not throw; release() frees what it can.
  }
}

void ShareableAllocation::create(int device, int64_t bytes) {
  const CUmemAllocationProp prop = allocation_properties(device);
  size_t granularity = 0;
  check(driver().mem_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  if (bytes <= 0 || bytes % static_cast<int64_t>(granularity) != 0) {
    throw std::invalid_argument("shareable allocation of " + std::to_string(bytes) +
                                " bytes must be a positive multiple of the granularity " + std::to_string(granularity));
  }
  CUmemGenericAllocationHandle allocation = 0;
  check(driver().mem_create(&allocation, static_cast<size_t>(bytes), &prop, 0), "cuMemCreate");
  allocation_ = allocation;
  bytes_ = bytes;
  int fd = -1;
  check(driver().mem_export(&fd, allocation, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
  exported_fd_ = fd;
  map(device, bytes);
}

void ShareableAllocation::import(int device, const std::string& handle, int64_t bytes) {
  const size_t colon = handle.find(':');
  if (colon == std::string::npos)
    throw std::invalid_argument("shareable handle must be 'pid:fd', got '" + handle + "'");
  const int pid = std::stoi(handle.substr(0, colon));
  const int remote_fd = std::stoi(handle.substr(colon + 1));
  const int fd = duplicate_descriptor(pid, remote_fd);
  CUmemGenericAllocationHandle allocation = 0;
  const CUresult status = driver().mem_import(&allocation, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);  // the imported handle holds its own reference
  check(status, "cuMemImportFromShareableHandle");
  allocation_ = allocation;
  bytes_ = bytes;
  map(device, bytes);
}

void ShareableAllocation::map(int device, int64_t bytes) {
  CUdeviceptr address = 0;
  check(driver().address_reserve(&address, static_cast<size_t>(bytes), 0, 0, 0), "cuMemAddressReserve");
  base_ = reinterpret_cast<uint8_t*>(address);
  check(driver().mem_map(address, static_cast<size_t>(bytes), 0, allocation_, 0), "cuMemMap");
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(driver().mem_set_access(address, static_cast<size_t>(bytes), &access, 1), "cuMemSetAccess");
}

std::string ShareableAllocation::handle() const {
  if (exported_fd_ < 0) throw std::logic_error("only a created allocation has a handle to share");
  return std::to_string(getpid()) + ":" + std::to_string(exported_fd_);
}

void ShareableAllocation::release() {
  const DriverApi& api = driver();
  if (base_ != nullptr) {
    // Unmapping an address that was reserved but not mapped fails harmlessly; free the range anyway.
    api.mem_unmap(reinterpret_cast<CUdeviceptr>(base_), static_cast<size_t>(bytes_));
    api.address_free(reinterpret_cast<CUdeviceptr>(base_), static_cast<size_t>(bytes_));
    base_ = nullptr;
  }
  if (allocation_ != 0) {
    api.mem_release(allocation_);
    allocation_ = 0;
  }
  if (exported_fd_ >= 0) {
    close(exported_fd_);
    exported_fd_ = -1;
  }
}

}  // namespace deep_ep
