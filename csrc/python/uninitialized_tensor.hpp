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
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdint>
#include <utility>

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

// A contiguous tensor of `sizes` and `dtype` on `block`'s storage from byte `byte_offset` (a multiple
// of the dtype's size), made without the dispatcher: narrow and view cost about 1 µs each on the
// host. It shares the storage like any view; the pieces of a block never overlap and the block never
// requires grad, so no autograd view record is needed.
inline at::Tensor tensor_in(const at::Tensor& block, int64_t byte_offset, at::IntArrayRef sizes, at::ScalarType dtype) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(block.storage()), block.key_set(),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous(sizes);
  impl->set_storage_offset((block.storage_offset() * block.element_size() + byte_offset) /
                           static_cast<int64_t>(c10::elementSize(dtype)));
  return at::Tensor::wrap_tensor_impl(std::move(impl));
}

}  // namespace deep_ep
