// CUDA kernel of v4_cross_entropy_loss (v4::ce::Rows in cross_entropy_loss.h): a block a row of
// logits. The first read forms the row's max and sum of exponentials online (each thread, then
// merged across the block), the second (with `grad`) writes the gradient over the logits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>

#include "cc/common/backend.h"
#include "cc/common/cuda_types.cuh"
#include "cc/ops/cross_entropy_loss.h"

namespace v4::ce {
namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;

// Running max m and sum s of exp(x - m) over part of a row; nan: a NaN was seen. log_softmax's
// result is NaN on the whole row where it holds a NaN or an infinity (x - max is NaN somewhere), so
// the final state turns those into NaN (an infinite m, or nan).
struct Stat {
  float m, s;
  bool nan;
};
constexpr Stat kEmpty{-INFINITY, 0.0f, false};

__device__ __forceinline__ void add(Stat& a, float x) {
  if (isnan(x)) a.nan = true;
  else if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;
    a.m = x;
  } else if (a.m > -INFINITY) {
    a.s += expf(x - a.m);
  }  // else x = m = -inf: nothing to add
}

__device__ __forceinline__ Stat merge(const Stat& a, const Stat& b) {
  Stat r = kEmpty;
  r.nan = a.nan || b.nan;
  if (b.m > a.m) {
    r.m = b.m;
    r.s = a.s * expf(a.m - b.m) + b.s;
  } else if (a.m > -INFINITY) {
    r.m = a.m;
    r.s = a.s + b.s * expf(b.m - a.m);
  }  // else both saw only -inf (or nothing): m = -inf, s = 0
  return r;
}

__device__ __forceinline__ Stat shuffle(const Stat& a, int o) {
  Stat b = kEmpty;
  b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
  b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
  b.nan = __shfl_xor_sync(0xffffffffu, static_cast<int>(a.nan), o) != 0;
  return b;
}

// 16 bytes of T at a time where the row allows, else one element at a time.
template <typename T>
__global__ void __launch_bounds__(kThreads) rows_kernel(T* logits, const int64_t* targets, int64_t V, float inv,
                                                        bool grad, bool vec, float* loss) {
  __shared__ Stat part[kWarps];
  __shared__ float lse_s, xt_s;
  const int64_t row = blockIdx.x, target = targets[row];
  const bool valid = target != kIgnore;
  T* x = logits + row * V;
  constexpr int N = Pack<T>::N;
  if (threadIdx.x == 0) xt_s = valid ? to_float(x[target]) : 0.0f;  // read before the gradient overwrites it
  Stat st = kEmpty;
  if (vec) {
    for (int64_t i = threadIdx.x * static_cast<int64_t>(N); i < V; i += static_cast<int64_t>(kThreads) * N) {
      const Pack<T> p = *reinterpret_cast<const Pack<T>*>(x + i);
#pragma unroll
      for (int j = 0; j < N; ++j) add(st, to_float(p.v[j]));
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) add(st, to_float(x[i]));
  }
  for (int o = 16; o > 0; o /= 2) st = merge(st, shuffle(st, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Stat all = part[0];
    for (int w = 1; w < kWarps; ++w) all = merge(all, part[w]);
    const float logsum = all.nan || isinf(all.m) ? NAN : logf(all.s);
    lse_s = logsum;
    part[0].m = all.m;
    // log_softmax(x)[t] = (x_t - max) - logsum, as ATen's epilogue computes it.
    loss[row] = valid ? -((xt_s - all.m) - logsum) : 0.0f;
  }
  __syncthreads();
  if (!grad) return;
  const float m = part[0].m, logsum = lse_s, g = valid ? inv : 0.0f;
  // exp(log_softmax) * g, then -g at the target (ATen: exp_, mul_, scatter_add_), rounded once.
  const auto gradient = [&](int64_t i, float v) {
    const float p = expf((v - m) - logsum) * g;
    return from_float<T>(i == target ? p + -g : p);
  };
  if (vec) {
    for (int64_t i = threadIdx.x * static_cast<int64_t>(N); i < V; i += static_cast<int64_t>(kThreads) * N) {
      Pack<T> p = *reinterpret_cast<const Pack<T>*>(x + i);
#pragma unroll
      for (int j = 0; j < N; ++j) p.v[j] = gradient(i + j, to_float(p.v[j]));
      *reinterpret_cast<Pack<T>*>(x + i) = p;
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) x[i] = gradient(i, to_float(x[i]));
  }
}

template <typename T>
void launch(Rows& r) {
  const int64_t c = r.logits.size(0), V = r.logits.size(1);
  r.loss = at::empty({c}, r.logits.options().dtype(at::kFloat));
  if (c == 0) return;
  T* x = static_cast<T*>(r.logits.data_ptr());
  const bool vec = V % Pack<T>::N == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  // 1 / normalizer as ATen divides a float32 tensor by a double: in float32.
  const float inv = 1.0f / static_cast<float>(r.normalizer);
  rows_kernel<T><<<c, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x, r.targets.const_data_ptr<int64_t>(), V, inv, r.grad, vec, r.loss.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool rows_cuda(Rows& r) {
  const c10::cuda::CUDAGuard guard(r.logits.device());
  if (!r.logits.is_contiguous() || !r.targets.is_contiguous() || r.logits.size(0) >= (int64_t{1} << 31)) return false;
  switch (r.logits.scalar_type()) {
    case at::kFloat: launch<float>(r); return true;
    case at::kBFloat16: launch<__nv_bfloat16>(r); return true;
    default: return false;
  }
}

const Backend<Kernel>::Register registered(c10::DeviceType::CUDA, &rows_cuda);

}  // namespace
}  // namespace v4::ce
