// Memory-ordering primitives with names that state their semantics. Kernels call these; no bare
// inline assembly appears in kernel logic.
//
// Scope: flags read by another GPU (or another process on this GPU through CUDA IPC) use .sys
// scope; .gpu scope is only for counters that never leave this device.
#pragma once

#include <cstdint>

namespace deep_ep::ptx {

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* ptr) {
  int64_t value;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ int32_t ld_relaxed_sys(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ int64_t ld_relaxed_sys(const int64_t* ptr) {
  int64_t value;
  asm volatile("ld.relaxed.sys.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys(int32_t* ptr, int32_t value) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_release_sys(int64_t* ptr, int64_t value) {
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void st_release_gpu(int32_t* ptr, int32_t value) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int32_t* ptr, int32_t value) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int64_t* ptr, int64_t value) {
  asm volatile("st.relaxed.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(int32_t* ptr, int32_t value) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Returns the previous value; acq_rel at gpu scope: used for "last CTA to arrive" detection.
__device__ __forceinline__ int32_t atomic_add_acq_rel_gpu(int32_t* ptr, int32_t value) {
  int32_t previous;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(previous) : "l"(ptr), "r"(value) : "memory");
  return previous;
}

// Orders this thread's earlier writes (including those it observed from its CTA after a
// __syncthreads) before its later writes, for observers on any GPU or the host.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t value;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(value));
  return value;
}

// Bulk prefetch of `bytes` (a multiple of 16, from a 16-byte aligned address) into L2 (sm_90); nothing
// to wait for, no register holds the data.
__device__ __forceinline__ void prefetch_l2_bulk(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

// 16-byte vector loads/stores for token rows. The non-coherent load is only for data no kernel of
// this launch writes.
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
  int4 value;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
               : "l"(ptr));
  return value;
}

__device__ __forceinline__ void st_na_v4(int4* ptr, const int4& value) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(value.x), "r"(value.y),
               "r"(value.z), "r"(value.w)
               : "memory");
}

}  // namespace deep_ep::ptx
