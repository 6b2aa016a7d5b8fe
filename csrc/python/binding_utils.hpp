// Conversions shared by the bindings: Python passes tensor.data_ptr() and stream.cuda_stream as ints.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deep_ep {

template <typename T>
T* pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

inline cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace deep_ep
