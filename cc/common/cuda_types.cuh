// Element conversions the CUDA kernels share: the kernels compute in float32 on float32 or bfloat16
// tensors.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

namespace v4 {

template <typename T>  // float or __nv_bfloat16
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return __float2bfloat16(x);
}

}  // namespace v4
