// CUDA kernels of the MoE seam (experts.h): the experts' SwiGLU (SwigluRows), one pass each way;
// and the combine (CombineRows), a block a token, reading its k routed rows once and writing its
// output row (forward), or its k rows' gradients over them and its k weights' gradients
// (backward). The ATen combine gathered the rows into a [block, k, H] copy, weighed them by a
// mixed-dtype broadcast and summed, and in the backward gathered them again in float32: about 3
// ms a layer of the GLM-5 proxy at 4,096 tokens.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cc/common/backend.h"
#include "cc/common/cuda_types.cuh"
#include "cc/common/experts.h"

namespace v4 {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kMaxK = static_cast<int>(kCombineMaxSlots);
static_assert(kCombineMaxRowBytes == 8 * kThreads * 16, "8 packs of 16 bytes a thread");

// out[t] = sum_j rounded(w[t, j] y[inverse[t k + j]]); pack p of a thread covers columns
// (threadIdx.x + p kThreads) N ...
template <typename T, int P>
__global__ void __launch_bounds__(kThreads) combine_forward(const T* y, const float* w, const int64_t* inverse, int k,
                                                            int H, T* out) {
  constexpr int N = Pack<T>::N;
  const int64_t t = blockIdx.x;
  float acc[P][N] = {};
  for (int j = 0; j < k; ++j) {
    const int64_t r = inverse[t * k + j];
    const float wj = w[t * k + j];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int c = (threadIdx.x + p * kThreads) * N;
      if (c >= H) continue;
      const Pack<T> in = *reinterpret_cast<const Pack<T>*>(y + r * H + c);
#pragma unroll
      for (int e = 0; e < N; ++e) acc[p][e] += to_float(from_float<T>(wj * to_float(in.v[e])));
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int c = (threadIdx.x + p * kThreads) * N;
    if (c >= H) continue;
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < N; ++e) o.v[e] = from_float<T>(acc[p][e]);
    *reinterpret_cast<Pack<T>*>(out + t * H + c) = o;
  }
}

// dw[t, j] = sum_h y[r, h] dout[t, h] (float32), then y[r] = rounded(dout[t] w[t, j]), r = inverse[t k + j].
template <typename T, int P>
__global__ void __launch_bounds__(kThreads) combine_backward(T* y, const float* w, const int64_t* inverse, int k, int H,
                                                             const T* dout, float* dw) {
  constexpr int N = Pack<T>::N;
  __shared__ float sm[kWarps][kMaxK];
  const int64_t t = blockIdx.x;
  float g[P][N];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int c = (threadIdx.x + p * kThreads) * N;
    Pack<T> in{};
    if (c < H) in = *reinterpret_cast<const Pack<T>*>(dout + t * H + c);
#pragma unroll
    for (int e = 0; e < N; ++e) g[p][e] = to_float(in.v[e]);
  }
  for (int j = 0; j < k; ++j) {
    const int64_t r = inverse[t * k + j];
    const float wj = w[t * k + j];
    float dot = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int c = (threadIdx.x + p * kThreads) * N;
      if (c >= H) continue;
      Pack<T>* row = reinterpret_cast<Pack<T>*>(y + r * H + c);
      const Pack<T> in = *row;
      Pack<T> grad;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        dot += to_float(in.v[e]) * g[p][e];
        grad.v[e] = from_float<T>(g[p][e] * wj);
      }
      *row = grad;
    }
    dot = warp_sum(dot);
    if (threadIdx.x % 32 == 0) sm[threadIdx.x / 32][j] = dot;
  }
  __syncthreads();
  if (threadIdx.x < k) {
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += sm[v][threadIdx.x];
    dw[t * k + threadIdx.x] = sum;
  }
}

template <typename T, int P>
void run(CombineRows& c, bool backward) {
  const int64_t T_ = c.w.size(0);
  const int k = static_cast<int>(c.w.size(1)), H = static_cast<int>(c.y_rows.size(1));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (!backward) {
    c.out = at::empty({T_, H}, c.y_rows.options());
    combine_forward<T, P><<<T_, kThreads, 0, stream>>>(static_cast<const T*>(c.y_rows.const_data_ptr()),
                                                       c.w.const_data_ptr<float>(), c.inverse.const_data_ptr<int64_t>(),
                                                       k, H, static_cast<T*>(c.out.data_ptr()));
  } else {
    c.dw = at::empty({T_, k}, c.w.options());
    combine_backward<T, P><<<T_, kThreads, 0, stream>>>(static_cast<T*>(c.y_rows.data_ptr()), c.w.const_data_ptr<float>(),
                                                        c.inverse.const_data_ptr<int64_t>(), k, H,
                                                        static_cast<const T*>(c.dout.const_data_ptr()),
                                                        c.dw.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fewest packs a thread that cover the row, up to those of kCombineMaxRowBytes.
template <typename T>
void launch(CombineRows& c, bool backward) {
  constexpr int kMaxPacks = kCombineMaxRowBytes / (kThreads * 16);
  with_packs<T, kThreads, kMaxPacks>(c.y_rows.size(1), [&](auto packs) { run<T, decltype(packs)::value>(c, backward); });
}

// act = rounded(rounded(silu(g)) u) for each of the 8-element groups of [rows, I], a thread a group
// at a time (grid-stride); backward: ds = rounded(dact u), du = rounded(dact silu(g)) and
// dg = rounded(ds sigma (1 + g (1 - sigma))), as autograd of at::silu(g) * u rounds.
template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* gate_up, int64_t rows, int I, const T* dact, T* act,
                                                          T* dgate_up) {
  constexpr int N = Pack<T>::N;
  const int groups = I / N;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < rows * groups;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i / groups;
    const int col = static_cast<int>(i % groups) * N;
    const Pack<T> g = *reinterpret_cast<const Pack<T>*>(gate_up + row * 2 * I + col);
    const Pack<T> u = *reinterpret_cast<const Pack<T>*>(gate_up + row * 2 * I + I + col);
    if (dact == nullptr) {
      Pack<T> a;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float x = to_float(g.v[e]);
        a.v[e] = from_float<T>(to_float(from_float<T>(x / (1.0f + expf(-x)))) * to_float(u.v[e]));
      }
      *reinterpret_cast<Pack<T>*>(act + row * I + col) = a;
      continue;
    }
    const Pack<T> d = *reinterpret_cast<const Pack<T>*>(dact + row * I + col);
    Pack<T> dg, du;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float x = to_float(g.v[e]), dy = to_float(d.v[e]), sig = 1.0f / (1.0f + expf(-x));
      const float silu = to_float(from_float<T>(x / (1.0f + expf(-x))));
      const float ds = to_float(from_float<T>(dy * to_float(u.v[e])));
      du.v[e] = from_float<T>(dy * silu);
      dg.v[e] = from_float<T>(ds * (sig * (1.0f + x * (1.0f - sig))));
    }
    *reinterpret_cast<Pack<T>*>(dgate_up + row * 2 * I + col) = dg;
    *reinterpret_cast<Pack<T>*>(dgate_up + row * 2 * I + I + col) = du;
  }
}

template <typename T>
void swiglu_launch(SwigluRows& s, bool backward) {
  const int64_t rows = s.gate_up.size(0);
  const int I = static_cast<int>(s.gate_up.size(1) / 2);
  const int64_t groups = rows * (I / Pack<T>::N);
  const int64_t blocks = std::min<int64_t>((groups + kThreads - 1) / kThreads, 8192);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const T* gu = static_cast<const T*>(s.gate_up.const_data_ptr());
  if (!backward) {
    s.act = at::empty({rows, I}, s.gate_up.options());
    swiglu_kernel<T><<<blocks, kThreads, 0, stream>>>(gu, rows, I, nullptr, static_cast<T*>(s.act.data_ptr()), nullptr);
  } else {
    s.dgate_up = at::empty_like(s.gate_up);
    swiglu_kernel<T><<<blocks, kThreads, 0, stream>>>(gu, rows, I, static_cast<const T*>(s.dact.const_data_ptr()), nullptr,
                                                      static_cast<T*>(s.dgate_up.data_ptr()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_cuda(SwigluRows& s, bool backward) {
  const c10::cuda::CUDAGuard guard(s.gate_up.device());
  if (s.gate_up.size(0) == 0) {
    if (backward) s.dgate_up = at::zeros_like(s.gate_up);
    else s.act = at::empty({0, s.gate_up.size(1) / 2}, s.gate_up.options());
    return;
  }
  switch (s.gate_up.scalar_type()) {
    case at::kFloat: return swiglu_launch<float>(s, backward);
    case at::kBFloat16: return swiglu_launch<__nv_bfloat16>(s, backward);
    default: TORCH_CHECK(false, "swiglu: the kernels take float32 or bfloat16, got ", s.gate_up.scalar_type());
  }
}

const Backend<SwigluKernel>::Register swiglu_registered(c10::DeviceType::CUDA, &swiglu_cuda);

void combine_cuda(CombineRows& c, bool backward) {
  const c10::cuda::CUDAGuard guard(c.y_rows.device());
  TORCH_CHECK(c.w.size(1) <= kMaxK, "combine: the kernels take at most ", kMaxK, " slots a token, got ", c.w.size(1));
  if (c.w.size(0) == 0) {  // no token: nothing to launch
    if (backward) c.dw = at::empty_like(c.w);
    else c.out = at::empty({0, c.y_rows.size(1)}, c.y_rows.options());
    return;
  }
  switch (c.y_rows.scalar_type()) {
    case at::kFloat: return launch<float>(c, backward);
    case at::kBFloat16: return launch<__nv_bfloat16>(c, backward);
    default: TORCH_CHECK(false, "combine: the kernels take float32 or bfloat16 rows, got ", c.y_rows.scalar_type());
  }
}

const Backend<CombineKernel>::Register registered(c10::DeviceType::CUDA, &combine_cuda);

}  // namespace
}  // namespace v4
