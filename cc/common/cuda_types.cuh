// Device helpers the CUDA kernels share: element conversions (the kernels compute in float32 on
// float32 or bfloat16 tensors), 16-byte packs, the pack count of a row and a warp's sum.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
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

// f(std::integral_constant<int, P>{}) with P the fewest Packs of T a thread, Threads threads a row,
// that cover `width` columns, P at most MaxPacks: the kernels that hold a row in registers.
template <typename T, int Threads, int MaxPacks, int P = 1, typename F>
void with_packs(int64_t width, F&& f) {
  if constexpr (P < MaxPacks) {
    if (width > int64_t(P) * Threads * Pack<T>::N) return with_packs<T, Threads, MaxPacks, P + 1>(width, f);
  }
  f(std::integral_constant<int, P>{});
}

// The sum of x over the warp's 32 lanes, in every lane.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace v4
