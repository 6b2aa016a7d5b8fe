// Uninitialised CUDA tensors for the C++ host path (bind_ht_host_path.cpp), made without the
// dispatcher. at::empty from C++ goes through the dispatcher, the factory's option handling and a
// device guard: 2.7-3.4 µs of host time per tensor, and a cached dispatch allocates four (an
// uncached one six) while the GPU waits. This takes the memory from the same allocator (torch's
// CUDA caching allocator, on the current stream of the current device, as at::empty does) and
// builds the tensor as at::empty's CUDA kernel does (at::detail::empty_generic): the tensors are
// what at::empty returns, with the same memory pool, stream association, statistics and free.
// Each output keeps an allocation of its own, as torch.empty's: returns that share storage are
// refused by torch.library custom ops (deep_ep.ops wraps dispatch in one).
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace deep_ep {

// Where at::empty does more than allocate: another current device (at::empty switches to the
// requested one), torch's deterministic mode with fill_uninitialized_memory (at::empty fills the
// new memory with NaN or the integer maximum, by dtype), and an active Python dispatch mode (a
// memory tracker or debug mode sees at::empty go through it). There the host path calls at::empty.
inline bool allocates_like_at_empty(int device) {
  const at::Context& context = at::globalContext();
  return c10::cuda::current_device() == device &&
         !(context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory()) &&
         !c10::impl::TorchDispatchModeTLS::any_modes_set();
}

// An uninitialised contiguous tensor of `sizes` and `dtype` on CUDA device `device`.
inline at::Tensor uninitialized_tensor(int device, at::IntArrayRef sizes, at::ScalarType dtype) {
  if (!allocates_like_at_empty(device)) {
    return at::empty(sizes, at::TensorOptions().device(at::kCUDA, device).dtype(dtype));
  }
  // What at::empty's CUDA kernel runs once it has the device: the allocator's memory, the CUDA key
  // (autograd keys added as for any CUDA tensor), contiguous sizes.
  return at::Tensor(at::detail::empty_generic(sizes, c10::cuda::CUDACachingAllocator::get(),
                                              c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype, std::nullopt));
}

}  // namespace deep_ep
