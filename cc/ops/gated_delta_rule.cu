// CUDA kernel of v4_gated_delta_rule: the recurrence across chunks (gdr::Recurrence in
// gated_delta_rule.h), forward and backward in one kernel, one launch per call whatever the
// length. Built by tools/build_ext.py where nvcc and a CUDA torch exist; registered for CUDA
// tensors with v4::Backend, so the op's ATen code needs no #ifdef. The work inside a chunk stays
// batched matrix products in ATen (tensor cores); what is sequential is this kernel.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "cc/common/backend.h"
#include "cc/ops/gated_delta_rule.h"

namespace v4::gdr {
namespace {

// A block owns kCols columns of one head's state [Dk, Dv] of one document, for all its chunks:
// the columns of S are independent in the recurrence (x's column j reads S's column j only).
constexpr int kCols = 32, kWarps = 8, kThreads = kWarps * 32, kMaxDk = 128;
constexpr int kRowsPerWarp = kChunk / kWarps;        // rows of x per warp: 8
constexpr int kStatePerWarp = kMaxDk / kWarps;       // rows of S per warp, at most: 16

struct Args {
  const float *base, *a, *b, *add, *decay;
  float *state_out, *x_out;
  const int64_t *chunks_of, *offset;
  float sign_a, sign_b;
  int heads, dk, dv;
  bool reverse;
};

// Shared memory: S [dk][kCols], a's and b's chunk tiles [64][dk], x [64][kCols].
__global__ void __launch_bounds__(kThreads) recurrence_kernel(Args p) {
  extern __shared__ float smem[];
  const int dk = p.dk;
  float* S = smem;
  float* A = S + dk * kCols;
  float* B = A + kChunk * dk;
  float* X = B + kChunk * dk;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int j = blockIdx.x * kCols + lane;  // this thread's column of the state
  const bool column = j < p.dv;
  const int h = blockIdx.y;
  const int64_t doc = blockIdx.z, chunks = p.chunks_of[doc];
  for (int i = threadIdx.x; i < dk * kCols; i += kThreads) S[i] = 0.0f;
  const bool vec = dk % 4 == 0;

  for (int64_t step = 0; step < chunks; ++step) {
    const int64_t c = p.reverse ? chunks - 1 - step : step;
    const int64_t chunk = p.offset[c] + doc;
    const int64_t tile = (chunk * p.heads + h) * kChunk * dk;  // a[chunk, h], b[chunk, h]
    const int64_t xs = (chunk * p.heads + h) * kChunk * p.dv;  // base / x_out [chunk, h]
    const int64_t ss = (chunk * p.heads + h) * (int64_t)dk * p.dv;  // add / state_out [chunk, h]
    __syncthreads();  // the previous step's reads of A, B and X are done
    if (vec) {
      const float4* a4 = reinterpret_cast<const float4*>(p.a + tile);
      const float4* b4 = reinterpret_cast<const float4*>(p.b + tile);
      for (int i = threadIdx.x; i < kChunk * dk / 4; i += kThreads) {
        reinterpret_cast<float4*>(A)[i] = a4[i];
        reinterpret_cast<float4*>(B)[i] = b4[i];
      }
    } else {
      for (int i = threadIdx.x; i < kChunk * dk; i += kThreads) {
        A[i] = p.a[tile + i];
        B[i] = p.b[tile + i];
      }
    }
    // state_out[c] = S (each thread its own column's rows: they are read below only after a barrier).
    if (column) {
      for (int k = warp; k < dk; k += kWarps) p.state_out[ss + (int64_t)k * p.dv + j] = S[k * kCols + lane];
    }
    __syncthreads();

    // x = base + sign_a * A S: this warp's 8 rows of column j.
    float acc[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      acc[r] = column ? p.base[xs + (int64_t)i * p.dv + j] : 0.0f;
    }
    float dot[kRowsPerWarp] = {};
    for (int k = 0; k < dk; ++k) {
      const float s = S[k * kCols + lane];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) dot[r] += A[(warp * kRowsPerWarp + r) * dk + k] * s;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      const float x = acc[r] + p.sign_a * dot[r];
      X[i * kCols + lane] = x;
      if (column) p.x_out[xs + (int64_t)i * p.dv + j] = x;
    }
    __syncthreads();

    // S = decay S + add + sign_b * B^T x: this warp's rows k = warp, warp + 8, ... of column j.
    const float decay = p.decay[chunk * p.heads + h];
    float upd[kStatePerWarp] = {};
    for (int i = 0; i < kChunk; ++i) {
      const float x = X[i * kCols + lane];
#pragma unroll
      for (int r = 0; r < kStatePerWarp; ++r) {
        const int k = warp + r * kWarps;
        if (k < dk) upd[r] += B[i * dk + k] * x;
      }
    }
#pragma unroll
    for (int r = 0; r < kStatePerWarp; ++r) {
      const int k = warp + r * kWarps;
      if (k < dk) {
        float s = decay * S[k * kCols + lane] + p.sign_b * upd[r];
        if (p.add != nullptr && column) s += p.add[ss + (int64_t)k * p.dv + j];
        S[k * kCols + lane] = s;
      }
    }
  }
}

bool recurrence_cuda(Recurrence& r, const Plan& plan) {
  const int64_t dk = r.a.size(-1), dv = r.base.size(-1), heads = r.base.size(1);
  const bool fits = r.base.scalar_type() == at::kFloat && dk <= kMaxDk && r.base.size(2) == kChunk &&
                    r.base.is_contiguous() && r.a.is_contiguous() && r.b.is_contiguous() && r.decay.is_contiguous() &&
                    (!r.add.defined() || r.add.is_contiguous()) && r.state_out.is_contiguous() && r.x_out.is_contiguous();
  if (!fits) return false;
  const c10::cuda::CUDAGuard guard(r.base.device());
  const size_t bytes = (dk * kCols + 2 * kChunk * dk + kChunk * kCols) * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(recurrence_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const at::Tensor chunks_of = plan.chunks_of.to(r.base.device()), offset = plan.offset_device.to(r.base.device());
  Args p{r.base.data_ptr<float>(), r.a.data_ptr<float>(), r.b.data_ptr<float>(),
         r.add.defined() ? r.add.data_ptr<float>() : nullptr, r.decay.data_ptr<float>(),
         r.state_out.data_ptr<float>(), r.x_out.data_ptr<float>(),
         chunks_of.data_ptr<int64_t>(), offset.data_ptr<int64_t>(),
         static_cast<float>(r.sign_a), static_cast<float>(r.sign_b),
         static_cast<int>(heads), static_cast<int>(dk), static_cast<int>(dv), r.reverse};
  const dim3 grid((dv + kCols - 1) / kCols, heads, plan.documents);
  recurrence_kernel<<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

const Backend<RecurrenceKernel>::Register registered(c10::DeviceType::CUDA, &recurrence_cuda);

}  // namespace
}  // namespace v4::gdr
