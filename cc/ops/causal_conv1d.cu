// CUDA kernels of v4_causal_conv1d (v4::conv::Conv in causal_conv1d.h): the forward a thread an
// output element; the backward a thread a channel, walking a tile of tokens with the last K
// tokens' inputs and pre-activation gradients in registers, so that x and dy are read once and
// dx written once (the ATen path's gathers and index_add passes were most of the convolution's
// time). A tap that reaches before its token's document is skipped, never multiplied by zero.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cc/common/backend.h"
#include "cc/common/cuda_types.cuh"
#include "cc/ops/causal_conv1d.h"

namespace v4::conv {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTile = 128;  // the tokens a backward block walks (4,096 x 8,192: 1,024 blocks)

// The tokens before t in its document: t - cu[d] for the d with cu[d] <= t < cu[d + 1] (cu rising
// from 0 to T over n + 1 entries; of equal entries, the last).
__device__ __forceinline__ int64_t document_of(const int64_t* cu, int64_t n, int64_t t) {
  int64_t lo = 0, hi = n;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

template <typename T, int K>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* x, const float* w, const int64_t* cu, int64_t n,
                                                           int64_t tokens, int64_t C, T* y) {
  const int64_t total = tokens * C;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = i / C, c = i % C, back = t - cu[document_of(cu, n, t)];
    float pre = w[c * K + K - 1] * to_float(x[i]);
#pragma unroll
    for (int j = 1; j < K; ++j) {
      if (j <= back) pre = fmaf(w[c * K + K - 1 - j], to_float(x[i - j * C]), pre);
    }
    y[i] = from_float<T>(pre * sigmoid(pre));
  }
}

// Block (tile, channel group): tokens [t0, t1) of channel c. The pre-activation gradient
// dp(s) = dy(s) silu'(pre(s)) for s up to t1 + K - 2 (the next tile's first K - 1 recomputed);
// dx(u) = sum_j dp(u + j) w[K-1-j] over the u + j of u's document, emitted once dp(u + K - 1) is
// known; dw[c][K-1-j] = sum_s dp(s) x(s - j) over the tile's s, into dw_part[tile].
template <typename T, int K>
__global__ void __launch_bounds__(kThreads) backward_kernel(const T* x, const T* dy, const float* w,
                                                            const int64_t* cu, int64_t n, int64_t tokens, int64_t C,
                                                            T* dx, float* dw_part) {
  const int64_t c = blockIdx.y * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (c >= C) return;
  const int64_t t0 = blockIdx.x * kTile, t1 = std::min(t0 + kTile, tokens);
  float wk[K], xs[K], dp[K], dw[K];  // xs[i], dp[i], back[i]: of token s - i (s - 1 - i before the shift)
  int64_t back[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    wk[k] = w[c * K + k];
    xs[k] = t0 - 1 - k >= 0 ? to_float(x[(t0 - 1 - k) * C + c]) : 0.0f;
    dp[k] = 0.0f;
    dw[k] = 0.0f;
    back[k] = -1;
  }
  int64_t d = document_of(cu, n, t0), start = cu[d], end = cu[d + 1];
  for (int64_t s = t0; s < t1 + K - 1; ++s) {
#pragma unroll
    for (int k = K - 1; k > 0; --k) {
      xs[k] = xs[k - 1];
      dp[k] = dp[k - 1];
      back[k] = back[k - 1];
    }
    if (s < tokens) {
      while (s >= end) {  // into s's document
        ++d;
        start = cu[d];
        end = cu[d + 1];
      }
      back[0] = s - start;
      xs[0] = to_float(x[s * C + c]);
      float pre = wk[K - 1] * xs[0];
#pragma unroll
      for (int j = 1; j < K; ++j) {
        if (j <= back[0]) pre = fmaf(wk[K - 1 - j], xs[j], pre);
      }
      const float sig = sigmoid(pre);
      dp[0] = to_float(dy[s * C + c]) * (sig * (1.0f + pre * (1.0f - sig)));
      if (s < t1) {
#pragma unroll
        for (int j = 0; j < K; ++j) {
          if (j <= back[0]) dw[K - 1 - j] = fmaf(dp[0], xs[j], dw[K - 1 - j]);
        }
      }
    } else {  // past the last token: nothing to add
      back[0] = -1;
      xs[0] = dp[0] = 0.0f;
    }
    const int64_t u = s - (K - 1);
    if (u >= t0) {
      float g = dp[K - 1] * wk[K - 1];  // j = 0: u itself
#pragma unroll
      for (int j = 1; j < K; ++j) {
        if (back[K - 1 - j] >= j) g = fmaf(dp[K - 1 - j], wk[K - 1 - j], g);
      }
      dx[u * C + c] = from_float<T>(g);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) dw_part[(blockIdx.x * C + c) * K + k] = dw[k];
}

template <typename T, int K>
void launch(Conv& cv, bool backward) {
  const int64_t tokens = cv.x.size(0), C = cv.x.size(1), n = cv.cu_seqlens.numel() - 1;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const T* x = static_cast<const T*>(cv.x.const_data_ptr());
  const float* w = cv.w.const_data_ptr<float>();
  const int64_t* cu = cv.cu_seqlens.const_data_ptr<int64_t>();
  if (!backward) {
    cv.y = at::empty_like(cv.x);
    const int64_t blocks = std::min<int64_t>((tokens * C + kThreads - 1) / kThreads, int64_t{1} << 20);
    forward_kernel<T, K><<<blocks, kThreads, 0, stream>>>(x, w, cu, n, tokens, C, static_cast<T*>(cv.y.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t tiles = (tokens + kTile - 1) / kTile, groups = (C + kThreads - 1) / kThreads;
  TORCH_CHECK(groups < 65536, "v4_causal_conv1d: more than 16.7M channels");
  cv.dx = at::empty_like(cv.x);
  at::Tensor dw_part = at::empty({tiles, C, K}, cv.x.options().dtype(at::kFloat));
  backward_kernel<T, K><<<dim3(tiles, groups), kThreads, 0, stream>>>(
      x, static_cast<const T*>(cv.dy.const_data_ptr()), w, cu, n, tokens, C, static_cast<T*>(cv.dx.data_ptr()),
      dw_part.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cv.dw = dw_part.sum(0);
}

template <typename T, int K = 1>
void with_kernel_size(Conv& cv, bool backward) {
  if constexpr (K < kMaxKernel) {
    if (cv.w.size(1) != K) return with_kernel_size<T, K + 1>(cv, backward);
  }
  launch<T, K>(cv, backward);
}

void conv_cuda(Conv& cv, bool backward) {
  const c10::cuda::CUDAGuard guard(cv.x.device());
  switch (cv.x.scalar_type()) {
    case at::kFloat: return with_kernel_size<float>(cv, backward);
    case at::kBFloat16: return with_kernel_size<__nv_bfloat16>(cv, backward);
    default: TORCH_CHECK(false, "v4_causal_conv1d: the kernels take float32 or bfloat16, got ", cv.x.scalar_type());
  }
}

const Backend<Kernel>::Register registered(c10::DeviceType::CUDA, &conv_cuda);

}  // namespace
}  // namespace v4::conv
