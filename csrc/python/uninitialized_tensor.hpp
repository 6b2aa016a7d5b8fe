// Uninitialised CUDA tensors for the C++ host path (bind_ht_host_path.cpp), made without the
// dispatcher. at::empty from C++ goes through the dispatcher, the factory's option handling and a
// device guard: 2.7-3.4 µs of host time per tensor, and a cached dispatch allocates four (an
// uncached one six) while the GPU waits. This takes the memory from the same allocator (torch's
// CUDA caching allocator, on the current stream of the current device, as at::empty does) and
// builds the tensor as at::empty's CUDA kernel does (at::detail::empty_generic): the tensors are
// what at::empty returns, with the same memory pool, stream association, statistics and free.
// The allocator's own call still costs ~1.8 µs, so small outputs that live together share one
// allocation (uninitialized_tensors).
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

namespace deep_ep {

// Where at::empty does more than allocate: another current device (at::empty switches to the
// requested one) and torch's deterministic mode with fill_uninitialized_memory (at::empty fills the
// new memory with NaN or the integer maximum, by dtype). There the host path calls at::empty.
inline bool allocates_like_at_empty(int device) {
  const at::Context& context = at::globalContext();
  return c10::cuda::current_device() == device &&
         !(context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory());
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

// The shape of one piece of uninitialized_tensors: [rows, columns], or [rows] when columns is 0.
struct PieceShape {
  int64_t rows;
  int64_t columns;
  at::ScalarType dtype;
};

// Uninitialised tensors of the given shapes (nullopt: no tensor) in one allocation, each piece
// starting at a multiple of 256 bytes (the kernels' vector stores need 16). The allocation is freed
// when the last piece goes: for outputs that live about as long as each other, and small next to
// what a caller frees separately (recv_x keeps its own).
template <size_t N>
std::array<std::optional<at::Tensor>, N> uninitialized_tensors(int device,
                                                               const std::array<std::optional<PieceShape>, N>& shapes) {
  constexpr int64_t kPieceAlignment = 256;
  std::array<std::optional<at::Tensor>, N> tensors;
  std::array<std::array<int64_t, 2>, N> dims{};
  const auto sizes_of = [&](size_t i) {
    dims[i] = {shapes[i]->rows, shapes[i]->columns};
    return at::IntArrayRef(dims[i].data(), shapes[i]->columns == 0 ? 1 : 2);
  };
  if (!allocates_like_at_empty(device)) {
    for (size_t i = 0; i < N; ++i) {
      if (shapes[i]) tensors[i] = uninitialized_tensor(device, sizes_of(i), shapes[i]->dtype);
    }
    return tensors;
  }
  if (std::none_of(shapes.begin(), shapes.end(), [](const auto& shape) { return shape.has_value(); })) {
    return tensors;
  }
  std::array<int64_t, N> offsets{};
  int64_t num_bytes = 0;
  for (size_t i = 0; i < N; ++i) {
    if (!shapes[i]) continue;
    offsets[i] = num_bytes;
    const int64_t bytes = shapes[i]->rows * std::max<int64_t>(shapes[i]->columns, 1) *
                          static_cast<int64_t>(c10::elementSize(shapes[i]->dtype));
    num_bytes += (bytes + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
  }
  const at::Tensor block = uninitialized_tensor(device, {num_bytes}, at::kByte);
  for (size_t i = 0; i < N; ++i) {
    if (shapes[i]) tensors[i] = tensor_in(block, offsets[i], sizes_of(i), shapes[i]->dtype);
  }
  return tensors;
}

}  // namespace deep_ep
