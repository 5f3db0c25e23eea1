// CUDA kernels of v4_rms_norm (v4::rms::Norm in rms_norm.h): a block a row, the row in registers,
// read and written 16 bytes at a time; forward and backward each one pass over their tensors (the
// ATen composition took about six float32 passes forward and ten backward, 5% of the GLM-5 proxy's
// 4,096-token step). The scale's gradient sums each block's rows, then the blocks (deterministic).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cc/common/backend.h"
#include "cc/common/cuda_types.cuh"
#include "cc/ops/rms_norm.h"

namespace v4::rms {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

// The sum of v over the block, in every thread; `sm` holds kWarps floats. Ends with a barrier, so
// the next call may reuse sm.
__device__ __forceinline__ float block_sum(float v, float* sm) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) sm[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += sm[w];
  __syncthreads();
  return total;
}

// Pack p of a thread covers columns (threadIdx.x + p kThreads) N ..; P packs a thread cover the row.
template <typename T, int P>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* x, const float* s, float eps, int H, T* y,
                                                           float* rstd) {
  constexpr int N = Pack<T>::N;
  __shared__ float sm[kWarps];
  const int64_t row = blockIdx.x;
  float v[P][N], ss = 0.0f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int c = (threadIdx.x + p * kThreads) * N;
    Pack<T> in{};
    if (c < H) in = *reinterpret_cast<const Pack<T>*>(x + row * H + c);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      v[p][e] = to_float(in.v[e]);
      ss += v[p][e] * v[p][e];
    }
  }
  const float r = rsqrtf(block_sum(ss, sm) / H + eps);
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int c = (threadIdx.x + p * kThreads) * N;
    if (c >= H) continue;
    Pack<T> out;
#pragma unroll
    for (int e = 0; e < N; ++e) out.v[e] = from_float<T>(v[p][e] * r * s[c + e]);
    *reinterpret_cast<Pack<T>*>(y + row * H + c) = out;
  }
  if (threadIdx.x == 0) rstd[row] = r;
}

// With xhat = x r and gs = dy s: dx = r (gs - xhat mean(gs xhat)), ds += dy xhat.
template <typename T, int P>
__global__ void __launch_bounds__(kThreads) backward_kernel(const T* x, const float* s, const float* rstd, const T* dy,
                                                            int64_t rows, int H, T* dx, float* ds_part) {
  constexpr int N = Pack<T>::N;
  __shared__ float sm[kWarps];
  float ds[P][N] = {};
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float r = rstd[row];
    float xh[P][N], gs[P][N], dot = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int c = (threadIdx.x + p * kThreads) * N;
      Pack<T> xin{}, gin{};
      if (c < H) {
        xin = *reinterpret_cast<const Pack<T>*>(x + row * H + c);
        gin = *reinterpret_cast<const Pack<T>*>(dy + row * H + c);
      }
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float g = to_float(gin.v[e]);
        xh[p][e] = to_float(xin.v[e]) * r;
        gs[p][e] = c < H ? g * s[c + e] : 0.0f;
        ds[p][e] += g * xh[p][e];
        dot += gs[p][e] * xh[p][e];
      }
    }
    dot = block_sum(dot, sm) / H;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int c = (threadIdx.x + p * kThreads) * N;
      if (c >= H) continue;
      Pack<T> out;
#pragma unroll
      for (int e = 0; e < N; ++e) out.v[e] = from_float<T>((gs[p][e] - xh[p][e] * dot) * r);
      *reinterpret_cast<Pack<T>*>(dx + row * H + c) = out;
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int c = (threadIdx.x + p * kThreads) * N;
    if (c >= H) continue;
#pragma unroll
    for (int e = 0; e < N; ++e) ds_part[blockIdx.x * int64_t(H) + c + e] = ds[p][e];
  }
}

template <typename T, int P>
void run(Norm& n, bool backward) {
  const int64_t rows = n.x.size(0);
  const int H = static_cast<int>(n.x.size(1));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto ptr = [](const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); };
  if (!backward) {
    n.y = at::empty_like(n.x);
    n.rstd = at::empty({rows}, n.x.options().dtype(at::kFloat));
    forward_kernel<T, P><<<rows, kThreads, 0, stream>>>(ptr(n.x), n.s.const_data_ptr<float>(), static_cast<float>(n.eps),
                                                        H, static_cast<T*>(n.y.data_ptr()), n.rstd.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // A few blocks a multiprocessor, each summing its rows' part of ds; then the blocks' parts.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, n.x.get_device()));
  const int64_t blocks = std::min<int64_t>(rows, 4 * sms);
  n.dx = at::empty_like(n.x);
  at::Tensor ds_part = at::empty({blocks, H}, n.x.options().dtype(at::kFloat));
  backward_kernel<T, P><<<blocks, kThreads, 0, stream>>>(ptr(n.x), n.s.const_data_ptr<float>(),
                                                         n.rstd.const_data_ptr<float>(), ptr(n.dy), rows, H,
                                                         static_cast<T*>(n.dx.data_ptr()), ds_part.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  n.ds = ds_part.sum(0);
}

// The fewest packs a thread that cover the row, up to those of kMaxWidth.
template <typename T>
void launch(Norm& n, bool backward) {
  constexpr int kMaxPacks = (kMaxWidth + kThreads * Pack<T>::N - 1) / (kThreads * Pack<T>::N);
  with_packs<T, kThreads, kMaxPacks>(n.x.size(1), [&](auto packs) { run<T, decltype(packs)::value>(n, backward); });
}

void rms_norm_cuda(Norm& n, bool backward) {
  const c10::cuda::CUDAGuard guard(n.x.device());
  TORCH_CHECK(n.x.dim() == 2 && n.x.size(1) % 8 == 0 && n.x.size(1) <= kMaxWidth && n.x.size(0) > 0,
              "v4_rms_norm: the kernels take [rows > 0, H] with H a multiple of 8 up to ", kMaxWidth, ", got ",
              n.x.sizes());
  switch (n.x.scalar_type()) {
    case at::kFloat: return launch<float>(n, backward);
    case at::kBFloat16: return launch<__nv_bfloat16>(n, backward);
    default: TORCH_CHECK(false, "v4_rms_norm: the kernels take float32 or bfloat16, got ", n.x.scalar_type());
  }
}

const Backend<Kernel>::Register registered(c10::DeviceType::CUDA, &rms_norm_cuda);

}  // namespace
}  // namespace v4::rms
