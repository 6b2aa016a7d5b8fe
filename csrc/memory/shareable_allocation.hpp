// Device memory that other processes import by reference count (CUDA virtual memory management):
// cuMemCreate with a POSIX file-descriptor handle, mapped into this process; a peer process takes a
// duplicate of that descriptor (pidfd_getfd) and maps the same physical memory.
//
// Why not cudaIpcGetMemHandle: with legacy IPC the memory goes away when the exporting process dies
// (importers then fault on their next access, and the fault poisons their CUDA context). Here every
// importer holds its own reference: a rank that dies leaves its window mapped in its peers, whose
// kernels can still time out cleanly and whose context survives.
//
// Driver entry points are looked up through the runtime (cudaGetDriverEntryPointByVersion), so the
// library does not link libcuda and imports on machines without a GPU driver.
#pragma once

#include <cstdint>
#include <string>

namespace deep_ep {

class ShareableAllocation {
 public:
  // Whether this process can create exportable allocations on `device` (driver support, and not
  // refused by the environment). Never throws.
  static bool supported(int device);

  ShareableAllocation() = default;
  ~ShareableAllocation();
  ShareableAllocation(const ShareableAllocation&) = delete;
  ShareableAllocation& operator=(const ShareableAllocation&) = delete;

  // Physical memory on `device`, mapped read/write for `device`; exported as a descriptor.
  void create(int device, int64_t bytes);
  // Maps the allocation `handle()` of another process (a peer on `device` or a peer GPU), mapped
  // read/write for `device`.
  void import(int device, const std::string& handle, int64_t bytes);

  // "pid:fd" of the exported descriptor: what a peer needs to import it (valid while this lives).
  std::string handle() const;
  uint8_t* base() const { return base_; }
  // Unmaps and drops this process's reference; the memory goes when the last process drops its own.
  void release();

 private:
  void map(int device, int64_t bytes);

  uint64_t allocation_ = 0;  // CUmemGenericAllocationHandle
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
  int exported_fd_ = -1;
};

}  // namespace deep_ep
