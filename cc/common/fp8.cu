// The FP8 checkpoints' weights dequantised on the GPU in one pass (lora.cc's dequantize asks for
// it): ATen's broadcast multiply over the blocks runs at a third of the memory bandwidth, which
// made an FP8 model's step 0.73x of the same model in bf16 (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "cc/common/backend.h"
#include "cc/common/lora.h"

namespace v4::cuda {
namespace {

constexpr int kBlock = 128;   // the checkpoints' scale block: 128 x 128 weights
constexpr int kVec = 16;      // weights a thread: one 16-byte load
constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T rounded(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 rounded<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half rounded<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float rounded<float>(float v) { return v; }

// out[m, r, c] = float(w[m, r, c]) * scale[m, r / 128, c / 128] in fp32, rounded once to T (what
// the reference computes). A thread's 16 weights share one scale: cols is a multiple of 16.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scale, T* __restrict__ out,
                      int64_t vecs, int64_t rows, int64_t cols, int64_t scale_rows, int64_t scale_cols) {
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < vecs; v += int64_t(gridDim.x) * kThreads) {
    const int64_t i = v * kVec, r = i / cols, c = i % cols, m = r / rows;
    const float s = scale[(m * scale_rows + (r % rows) / kBlock) * scale_cols + c / kBlock];
    const uint4 packed = *reinterpret_cast<const uint4*>(w + i);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&packed);
    __align__(16) T values[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      __nv_fp8_e4m3 f;
      f.__x = bytes[j];
      values[j] = rounded<T>(float(f) * s);
    }
#pragma unroll
    for (int j = 0; j < int(kVec * sizeof(T) / 16); ++j)
      reinterpret_cast<uint4*>(out + i)[j] = reinterpret_cast<const uint4*>(values)[j];
  }
}

bool dequantize_fp8(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype, at::Tensor& out) {
  if (!weight.is_cuda() || weight.scalar_type() != at::kFloat8_e4m3fn || weight.numel() == 0) return false;
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) return false;  // (float64: ATen)
  const int64_t rows = weight.size(-2), cols = weight.size(-1);
  if (cols % kVec != 0) return false;
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = weight.contiguous(), s = scale.to(at::kFloat).contiguous();
  if (reinterpret_cast<uintptr_t>(w.const_data_ptr()) % 16 != 0) return false;
  out = at::empty(weight.sizes(), weight.options().dtype(dtype));
  const int64_t vecs = w.numel() / kVec;
  const int blocks = int(std::min<int64_t>((vecs + kThreads - 1) / kThreads, int64_t(132) * 16));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    dequantize_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(w.const_data_ptr()),
                                                         s.const_data_ptr<float>(), typed, vecs, rows, cols,
                                                         s.size(-2), s.size(-1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (dtype == at::kBFloat16) launch(reinterpret_cast<__nv_bfloat16*>(out.mutable_data_ptr()));
  else if (dtype == at::kHalf) launch(reinterpret_cast<__half*>(out.mutable_data_ptr()));
  else launch(out.mutable_data_ptr<float>());
  return true;
}

const Backend<Fp8Dequantize>::Register registered(c10::DeviceType::CUDA, &dequantize_fp8);

}  // namespace
}  // namespace v4::cuda
