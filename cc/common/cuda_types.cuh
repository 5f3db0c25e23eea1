// Device helpers the CUDA kernels share: element conversions (the kernels compute in float32 on
// float32 or bfloat16 tensors), 16-byte packs and a warp's sum.
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

// N elements of T in 16 bytes, aligned so that a Pack is one 16-byte load or store.
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// The sum of x over the warp's 32 lanes, in every lane.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace v4
