// The FP8 checkpoints' weights on the GPU. Dequantised in one pass (lora.cc's dequantize asks for
// it): ATen's broadcast multiply over the blocks runs at a third of the memory bandwidth, which
// made an FP8 model's step 0.73x of the same model in bf16 (docs/benchmarks.md). And the forward
// product x W^T on FP8 tensor cores (Fp8Linear, issue 16's path (a)): x quantised here per row per
// 128 columns, then torch's blockwise FP8 GEMM (cuBLAS, 1x128 activation and 128x128 weight scales).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#include "cc/common/backend.h"
#include "cc/common/fp8.cuh"
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

// A grid-stride loop's place (major, minor) in a flat index major * n + minor, stepped by the
// stride's parts (d_major, d_minor) without a division (int64 divisions, a long software sequence,
// were most of the loops' instructions); minor + d_minor < 2 n.
__device__ __forceinline__ void advance(int64_t& major, int64_t& minor, int64_t d_major, int64_t d_minor, int64_t n) {
  minor += d_minor;
  const bool carry = minor >= n;
  if (carry) minor -= n;
  major += d_major + carry;
}

// out[m, r, c] = float(w[m, r, c]) * scale[m, r / 128, c / 128] in fp32, rounded once to T (what
// the reference computes). A thread's 16 weights share one scale: cols is a multiple of 16. The
// thread's place (m, r, c), vector c of row r of matrix m, advances with its index by the grid's
// stride in the same parts (step), which the host divides out. Most launches are one pass of the
// loop (the dense maps), and with the stride's parts and the first place divided in every thread
// (six int64 divisions) the GLM-5 proxy's 70 launches took 3.09 ms against 2.64 with the place
// divided in each pass (H100, 2026-12-06). The first place's divisions are 32-bit (a thread's
// index, rows and vectors a row are under 2^31).
struct Steps {
  int64_t m, r, c;
};
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scale, T* __restrict__ out,
                      int64_t vecs, int64_t rows, int64_t cols, int64_t scale_rows, int64_t scale_cols, Steps step) {
  const uint32_t per_row = uint32_t(cols / kVec), v0 = blockIdx.x * kThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kThreads, step_c = step.c, step_r = step.r, step_m = step.m;
  int64_t c = v0 % per_row, r = v0 / per_row % uint32_t(rows), m = v0 / per_row / uint32_t(rows);
  for (int64_t v = v0; v < vecs; v += stride) {
    const int64_t i = v * kVec;
    const float s = scale[(m * scale_rows + r / kBlock) * scale_cols + c * kVec / kBlock];
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
    advance(r, c, step_r, step_c, per_row);  // (r may pass rows once: the next call carries it)
    advance(m, r, step_m, 0, rows);
  }
}

bool dequantize_fp8(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype, at::Tensor& out) {
  if (!weight.is_cuda() || weight.scalar_type() != at::kFloat8_e4m3fn || weight.numel() == 0) return false;
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) return false;  // (float64: ATen)
  const int64_t rows = weight.size(-2), cols = weight.size(-1);
  if (cols % kVec != 0) return false;
  if (rows >= (int64_t(1) << 31) || cols / kVec >= (int64_t(1) << 31)) return false;  // (the kernel's 32-bit place)
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = weight.contiguous(), s = scale.to(at::kFloat).contiguous();
  if (reinterpret_cast<uintptr_t>(w.const_data_ptr()) % 16 != 0) return false;
  out = at::empty(weight.sizes(), weight.options().dtype(dtype));
  const int64_t vecs = w.numel() / kVec;
  const int blocks = int(std::min<int64_t>((vecs + kThreads - 1) / kThreads, int64_t(132) * 16));
  const int64_t stride = int64_t(blocks) * kThreads, per_row = cols / kVec;
  const Steps step{stride / per_row / rows, stride / per_row % rows, stride % per_row};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    dequantize_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(w.const_data_ptr()),
                                                         s.const_data_ptr<float>(), typed, vecs, rows, cols,
                                                         s.size(-2), s.size(-1), step);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (dtype == at::kBFloat16) launch(reinterpret_cast<__nv_bfloat16*>(out.mutable_data_ptr()));
  else if (dtype == at::kHalf) launch(reinterpret_cast<__half*>(out.mutable_data_ptr()));
  else launch(out.mutable_data_ptr<float>());
  return true;
}

const Backend<Fp8Dequantize>::Register registered(c10::DeviceType::CUDA, &dequantize_fp8);

constexpr float kE4m3Max = 448.0f;  // float8_e4m3fn's largest finite value
constexpr int kLanes = 8;           // activations a lane (one 16-byte load): a half-warp takes one 1 x 128 block
constexpr int kItems = 2;           // pairs of blocks a warp has in flight at once
// Rows padded to a multiple of this: the activation scales' leading dimension (rows) then stays
// 16-byte aligned, which cuBLAS asks of its scale tensors' addresses (pytorch PR 159957); the
// padding rows are zeros and are sliced off the output.
constexpr int64_t kRowPad = 16;

// q[r, c] = x[r, c] / s rounded to the nearest e4m3 (saturating at 448), with s = amax / 448 over
// row r's block b of 128 columns (1 for a zero block; never below FLT_MIN, where a subnormal bf16
// amax would divide by zero), stored at scale[b * padded + r]: cuBLAS's 1 x 128 scales, [rows, K/128]
// column-major. Rows from `rows` to `padded` are zeros of scale 1. A NaN activation stays NaN; an
// infinite one becomes NaN (e4m3fn has no infinity) and the rest of its block zeros. A warp takes
// a pair of blocks of a row (b even, b + 1) a half-warp each, kItems pairs at once where the grid
// is capped, their loads issued before any is used (a block a warp, 8 bytes a lane, kept too few
// bytes in flight: 1.8 TB/s on the H100); the loop and the shuffles are warp-uniform. An item's
// (row, pair) advances with its index.
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t rows, int64_t padded,
                         int64_t blocks, uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int lane = threadIdx.x % 32, half = lane / 16, at = lane % 16 * kLanes;
  const int64_t cols = blocks * kBlock, pairs = (blocks + 1) / 2;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32), w0 = (blockIdx.x * int64_t(kThreads) + threadIdx.x) / 32;
  // Item it + 1 is `warps` items after item it; the next round kItems * warps after this one.
  const int64_t item_r = warps / pairs, item_p = warps % pairs;
  const int64_t round_r = warps * kItems / pairs, round_p = warps * kItems % pairs;
  for (int64_t r0 = w0 / pairs, p0 = w0 % pairs; r0 < padded; advance(r0, p0, round_r, round_p, pairs)) {
    float v[kItems][kLanes];
    int64_t r[kItems], b[kItems];
    bool live[kItems];
    int64_t ri = r0, pi = p0;
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      if (it > 0) advance(ri, pi, item_r, item_p, pairs);
      r[it] = ri;
      b[it] = pi * 2 + half;
      live[it] = ri < padded && b[it] < blocks;
      uint4 packed = make_uint4(0, 0, 0, 0);
      if (live[it] && r[it] < rows) packed = *reinterpret_cast<const uint4*>(x + r[it] * ldx + b[it] * kBlock + at);
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&packed);
#pragma unroll
      for (int j = 0; j < kLanes; ++j) v[it][j] = __bfloat162float(h[j]);
    }
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kLanes; ++j) amax = fmaxf(amax, fabsf(v[it][j]));
#pragma unroll
      for (int offset = 8; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      const float s = amax > 0.0f ? fmaxf(amax / kE4m3Max, FLT_MIN) : 1.0f;
      uint2 packed_q = make_uint2(0, 0);
#pragma unroll
      for (int j = 0; j < kLanes; ++j) {  // v / s: an IEEE division (no fast math), then one e4m3 rounding
        const uint32_t e = __nv_cvt_float_to_fp8(v[it][j] / s, __NV_SATFINITE, __NV_E4M3);
        (j < 4 ? packed_q.x : packed_q.y) |= e << (8 * (j % 4));
      }
      if (!live[it]) continue;
      *reinterpret_cast<uint2*>(q + r[it] * cols + b[it] * kBlock + at) = packed_q;
      if (at == 0) scale[b[it] * padded + r[it]] = s;
    }
  }
}

// torch's blockwise FP8 GEMM (aten::_scaled_mm_v2, cuBLAS on sm90): a [M, K] row-major FP8 with
// 1 x 128 scales times b [K, N] column-major FP8 with 128 x 128 scales, in bf16, fp32 accumulation
// (no fast accumulation). Called through the dispatcher with its arguments by name: its C++
// signature has moved between torch releases, and a build against another torch then still
// compiles (an argument it does not know with a default takes the default). Empty on a refusal,
// which is warned once with torch's reason.
at::Tensor blockwise_fp8_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b) {
  constexpr int64_t kBlockWise1x128 = 4, kBlockWise128x128 = 5;  // at::blas::ScalingType
  static const auto op = c10::Dispatcher::singleton().findSchema({"aten::_scaled_mm_v2", ""});
  if (!op) {
    TORCH_WARN_ONCE("v4 FP8 linear: this torch has no aten::_scaled_mm_v2; FP8 weights are dequantised instead");
    return {};
  }
  torch::jit::Stack stack;
  for (const auto& arg : op->schema().arguments()) {
    const std::string& name = arg.name();
    if (name == "self") stack.emplace_back(a);
    else if (name == "mat2") stack.emplace_back(b);
    else if (name == "scale_a") stack.emplace_back(std::vector<at::Tensor>{scale_a});
    else if (name == "scale_b") stack.emplace_back(std::vector<at::Tensor>{scale_b});
    else if (name == "recipe_a") stack.emplace_back(std::vector<int64_t>{kBlockWise1x128});
    else if (name == "recipe_b") stack.emplace_back(std::vector<int64_t>{kBlockWise128x128});
    else if (name == "swizzle_a" || name == "swizzle_b") stack.emplace_back(std::vector<int64_t>{});
    else if (name == "bias") stack.emplace_back();
    else if (name == "out_dtype") stack.emplace_back(at::kBFloat16);
    else if (name == "use_fast_accum") stack.emplace_back(false);
    else if (arg.default_value()) stack.push_back(*arg.default_value());
    else {
      TORCH_WARN_ONCE("v4 FP8 linear: aten::_scaled_mm_v2 has an argument ", name,
                      " without a default that this build does not fill; FP8 weights are dequantised instead");
      return {};
    }
  }
  try {
    op->callBoxed(&stack);
  } catch (const c10::Error& e) {
    TORCH_WARN_ONCE("v4 FP8 linear: torch's blockwise FP8 GEMM refused a ", a.sizes(), " x ", b.sizes(),
                    " product (", e.what_without_backtrace(), "); FP8 weights are dequantised where it refuses");
    return {};
  }
  return stack.at(0).toTensor();
}

}  // namespace

void quantize_rows(const at::Tensor& x, at::Tensor& q, at::Tensor& scale) {
  at::Tensor rows = x;
  if (rows.stride(1) != 1 || rows.stride(0) % kLanes != 0 ||
      reinterpret_cast<uintptr_t>(rows.const_data_ptr()) % (kLanes * sizeof(__nv_bfloat16)) != 0)
    rows = rows.clone(at::MemoryFormat::Contiguous);  // (contiguous() is x itself where x is contiguous)
  const int64_t m = rows.size(0), k = rows.size(1);
  const int64_t blocks = k / kBlock, padded = (m + kRowPad - 1) / kRowPad * kRowPad;
  q = at::empty({padded, k}, x.options().dtype(at::kFloat8_e4m3fn));
  scale = at::empty({blocks, padded}, x.options().dtype(at::kFloat));
  const int64_t warps = padded * ((blocks + 1) / 2);  // a pair of blocks a warp
  const int grid = int(std::min<int64_t>((warps + kThreads / 32 - 1) / (kThreads / 32), int64_t(132) * 8));
  if (grid == 0) return;  // no rows or no columns
  quantize_rows_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(rows.const_data_ptr()), rows.stride(0), m, padded, blocks,
      static_cast<uint8_t*>(q.mutable_data_ptr()), scale.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// Asked for by lora.cc where fp8_tensor_cores() names dense_forward: measured on the proxies it
// gives about 1% of a step while the activations' e4m3 rounding moves the loss after 50 LoRA steps
// by 4-6% (docs/benchmarks.md).
bool fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor& out) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || x.dim() < 1) return false;
  if (weight.dim() != 2 || weight.scalar_type() != at::kFloat8_e4m3fn || weight.device() != x.device()) return false;
  const int64_t n = weight.size(0), k = weight.size(1);
  // Whole blocks only: a partial one would need the zero padding that the checkpoints' scales
  // do not describe.
  if (n == 0 || k == 0 || n % kBlock != 0 || k % kBlock != 0 || x.size(-1) != k) return false;
  const int64_t m = x.numel() / k;
  if (m == 0 || !weight.is_contiguous() || reinterpret_cast<uintptr_t>(weight.const_data_ptr()) % 16 != 0) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q, scale_a;
  quantize_rows(x.reshape({m, k}), q, scale_a);
  const int64_t blocks = k / kBlock;
  // cuBLAS reads the weight's scales as [round_up(K/128, 4), N/128] column-major (torch checks it
  // since pytorch PR 166752; before, K/128 % 4 != 0 gave wrong answers): the checkpoint's
  // [N/128, K/128] row-major scales transposed, their rows padded to a multiple of 4 blocks where
  // K/128 is not one.
  at::Tensor scale_b = scale.to(at::kFloat);
  const int64_t blocks4 = (blocks + 3) / 4 * 4;
  if (blocks4 != blocks || !scale_b.is_contiguous() ||
      reinterpret_cast<uintptr_t>(scale_b.const_data_ptr()) % 16 != 0) {
    at::Tensor padded_b = at::zeros({n / kBlock, blocks4}, scale_b.options());
    padded_b.narrow(1, 0, blocks).copy_(scale_b);
    scale_b = padded_b;
  }
  const at::Tensor y = blockwise_fp8_mm(q, weight.t(), scale_a.t(), scale_b.t());
  if (!y.defined()) return false;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  out = y.narrow(0, 0, m).view(sizes);  // the first m rows of a row-major [padded, n]: contiguous
  return true;
}

const Backend<Fp8Linear>::Register registered_linear(c10::DeviceType::CUDA, &fp8_linear);
const Backend<Fp8QuantizeRows>::Register registered_quantize(
    c10::DeviceType::CUDA, [](const at::Tensor& x, at::Tensor& q, at::Tensor& scale) {
      if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || x.dim() != 2 || x.size(1) % kBlock != 0) return false;
      const c10::cuda::CUDAGuard guard(x.device());
      quantize_rows(x, q, scale);
      return true;
    });

}  // namespace
}  // namespace v4::cuda
