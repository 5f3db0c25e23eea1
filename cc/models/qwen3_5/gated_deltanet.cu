// CUDA kernels of Gated DeltaNet's gated RMSNorm (v4::gdn::GatedNorm in gated_deltanet.h): a warp a
// row, the row in registers, forward and backward each one pass over its tensors (the ATen
// composition took about ten elementwise passes forward and more backward). The weight's gradient
// sums each block's rows, then the blocks (deterministic).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cc/common/backend.h"
#include "cc/common/cuda_types.cuh"
#include "cc/models/qwen3_5/gated_deltanet.h"

namespace v4::gdn {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kPer = static_cast<int>(kMaxNormWidth) / 32;
constexpr int64_t kMaxBlocks = 1024;

// v rounded to T, as the reference's tensors of dtype T hold it.
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  return to_float(from_float<T>(v));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* x, const T* z, const T* w, float eps, int64_t rows,
                                                           int D, T* y, float* rstd) {
  const int lane = threadIdx.x % 32;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    float xv[kPer], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      xv[k] = c < D ? to_float(x[row * D + c]) : 0.0f;
      ss += xv[k] * xv[k];
    }
    const float r = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      if (c >= D) continue;
      const float zv = to_float(z[row * D + c]), wn = rounded<T>(to_float(w[c]) * rounded<T>(xv[k] * r));
      y[row * D + c] = from_float<T>(wn * (zv / (1.0f + expf(-zv))));
    }
    if (lane == 0) rstd[row] = r;
  }
}

// With xn = x r: d(w n) = dy silu(z), dz = dy (w n) silu'(z), dn = d(w n) w, dw += d(w n) n,
// dx = r (dn - xn mean(dn xn)).
template <typename T>
__global__ void __launch_bounds__(kThreads) backward_kernel(const T* x, const T* z, const T* w, const float* rstd,
                                                            const T* dy, int64_t rows, int D, T* dx, T* dz,
                                                            float* dw_part) {
  __shared__ float dw_s[kWarps][kMaxNormWidth];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float dw[kPer] = {};
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kWarps) + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const float r = rstd[row];
    float xn[kPer], dn[kPer], dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      xn[k] = dn[k] = 0.0f;
      if (c >= D) continue;
      xn[k] = to_float(x[row * D + c]) * r;
      const float zv = to_float(z[row * D + c]), g = to_float(dy[row * D + c]), wv = to_float(w[c]);
      const float n = rounded<T>(xn[k]), wn = rounded<T>(wv * n), sig = 1.0f / (1.0f + expf(-zv));
      const float dwn = g * zv * sig;
      dz[row * D + c] = from_float<T>(g * wn * (sig * (1.0f + zv * (1.0f - sig))));
      dn[k] = dwn * wv;
      dw[k] += dwn * n;
      dot += dn[k] * xn[k];
    }
    dot = warp_sum(dot) / D;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      if (c < D) dx[row * D + c] = from_float<T>(r * (dn[k] - xn[k] * dot));
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) dw_s[warp][lane + 32 * k] = dw[k];
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += kThreads) {
    float sum = 0.0f;
    for (int v = 0; v < kWarps; ++v) sum += dw_s[v][c];
    dw_part[blockIdx.x * D + c] = sum;
  }
}

template <typename T>
void launch(GatedNorm& n, bool backward) {
  const int64_t rows = n.x.numel() / n.x.size(-1);
  const int D = static_cast<int>(n.x.size(-1));
  const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, kMaxBlocks);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto ptr = [](const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); };
  if (!backward) {
    n.y = at::empty_like(n.x);
    n.rstd = at::empty({rows}, n.x.options().dtype(at::kFloat));
    forward_kernel<T><<<blocks, kThreads, 0, stream>>>(ptr(n.x), ptr(n.z), ptr(n.w), static_cast<float>(n.eps), rows, D,
                                                       static_cast<T*>(n.y.data_ptr()), n.rstd.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  n.dx = at::empty_like(n.x);
  n.dz = at::empty_like(n.z);
  at::Tensor dw_part = at::empty({blocks, D}, n.x.options().dtype(at::kFloat));
  backward_kernel<T><<<blocks, kThreads, 0, stream>>>(ptr(n.x), ptr(n.z), ptr(n.w), n.rstd.const_data_ptr<float>(),
                                                      ptr(n.dy), rows, D, static_cast<T*>(n.dx.data_ptr()),
                                                      static_cast<T*>(n.dz.data_ptr()), dw_part.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  n.dw = dw_part.sum(0);
}

void gated_norm_cuda(GatedNorm& n, bool backward) {
  const c10::cuda::CUDAGuard guard(n.x.device());
  switch (n.x.scalar_type()) {
    case at::kFloat: return launch<float>(n, backward);
    case at::kBFloat16: return launch<__nv_bfloat16>(n, backward);
    default: TORCH_CHECK(false, "v4_gated_deltanet: the gated norm's kernels take float32 or bfloat16, got ",
                         n.x.scalar_type());
  }
}

const Backend<GatedNormKernel>::Register registered(c10::DeviceType::CUDA, &gated_norm_cuda);

}  // namespace
}  // namespace v4::gdn
