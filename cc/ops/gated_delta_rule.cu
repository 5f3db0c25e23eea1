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
// Thread (warp w, lane l) holds column l: rows w*8 .. w*8+7 of x, and `per_warp` rows of S.
constexpr int kCols = 32, kWarps = 8, kThreads = kWarps * 32, kMaxDk = 128;
constexpr int kRowsPerWarp = kChunk / kWarps;   // rows of x per warp: 8
constexpr int kStatePerWarp = kMaxDk / kWarps;  // rows of S per warp, at most: 16

struct Args {
  const float *base, *a, *b, *add, *decay;
  float *state_out, *x_out;
  const int64_t *chunks_of, *offset;
  float sign_a, sign_b;
  int heads, dk, dv;
  bool reverse;
};

// 16 bytes global -> shared without passing through registers (Ampere's cp.async): the next
// chunk's tiles load while this one computes.
__device__ __forceinline__ void copy16(float* smem, const float* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void copies_done() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::);
}

// The tiles a[chunk, h] and b[chunk, h] ([64, dk] each) into A and B.
template <bool kVec>
__device__ __forceinline__ void load_tiles(float* A, float* B, const Args& p, int64_t tile) {
  const int n = kChunk * p.dk;
  if constexpr (kVec) {
    for (int i = threadIdx.x * 4; i < n; i += kThreads * 4) {
      copy16(A + i, p.a + tile + i);
      copy16(B + i, p.b + tile + i);
    }
  } else {
    for (int i = threadIdx.x; i < n; i += kThreads) {
      A[i] = p.a[tile + i];
      B[i] = p.b[tile + i];
    }
  }
}

// kVec: dk a multiple of 32 (Qwen3.5's 128), so that each warp's S rows and every tile row start on
// 16 bytes: shared reads four floats at a time. Shared memory: S [dk][kCols], two stages of a's
// and b's tiles [64][dk], x [64][kCols].
template <bool kVec>
__global__ void __launch_bounds__(kThreads) recurrence_kernel(Args p) {
  extern __shared__ __align__(16) float smem[];
  const int dk = p.dk, tile_floats = kChunk * dk;
  float* S = smem;
  float* tiles = S + dk * kCols;  // stage s: A at tiles + 2 s tile_floats, B after it
  float* X = tiles + 4 * tile_floats;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int j = blockIdx.x * kCols + lane;  // this thread's column of the state
  const bool column = j < p.dv;
  const int h = blockIdx.y;
  const int64_t doc = blockIdx.z, chunks = p.chunks_of[doc];
  const int per_warp = (dk + kWarps - 1) / kWarps, first = warp * per_warp;  // this warp's rows of S
  for (int i = threadIdx.x; i < dk * kCols; i += kThreads) S[i] = 0.0f;
  const auto chunk_at = [&](int64_t step) { return p.offset[p.reverse ? chunks - 1 - step : step] + doc; };
  if (chunks > 0) load_tiles<kVec>(tiles, tiles + tile_floats, p, (chunk_at(0) * p.heads + h) * tile_floats);

  for (int64_t step = 0; step < chunks; ++step) {
    const int64_t chunk = chunk_at(step);
    const float* A = tiles + (step % 2) * 2 * tile_floats;
    const float* B = A + tile_floats;
    const int64_t xs = (chunk * p.heads + h) * kChunk * p.dv;       // base / x_out [chunk, h]
    const int64_t ss = (chunk * p.heads + h) * (int64_t)dk * p.dv;  // add / state_out [chunk, h]
    copies_done();
    __syncthreads();  // this step's tiles are in; the last step's reads of the other stage are done
    if (step + 1 < chunks) {
      float* next = tiles + ((step + 1) % 2) * 2 * tile_floats;
      load_tiles<kVec>(next, next + tile_floats, p, (chunk_at(step + 1) * p.heads + h) * tile_floats);
    }
    // state_out = S: this thread's own rows, which only it wrote.
    if (column) {
      for (int r = 0; r < per_warp && first + r < dk; ++r) {
        p.state_out[ss + (int64_t)(first + r) * p.dv + j] = S[(first + r) * kCols + lane];
      }
    }

    // x = base + sign_a * A S: this warp's 8 rows of column j.
    float dot[kRowsPerWarp] = {};
    const float* Aw = A + warp * kRowsPerWarp * dk;
    if constexpr (kVec) {
      for (int k = 0; k < dk; k += 4) {
        const float s0 = S[k * kCols + lane], s1 = S[(k + 1) * kCols + lane], s2 = S[(k + 2) * kCols + lane],
                    s3 = S[(k + 3) * kCols + lane];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const float4 a = *reinterpret_cast<const float4*>(Aw + r * dk + k);
          dot[r] += a.x * s0 + a.y * s1 + a.z * s2 + a.w * s3;
        }
      }
    } else {
      for (int k = 0; k < dk; ++k) {
        const float s = S[k * kCols + lane];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) dot[r] += Aw[r * dk + k] * s;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      const float x = (column ? p.base[xs + (int64_t)i * p.dv + j] : 0.0f) + p.sign_a * dot[r];
      X[i * kCols + lane] = x;
      if (column) p.x_out[xs + (int64_t)i * p.dv + j] = x;
    }
    __syncthreads();

    // S = decay S + add + sign_b * B^T x: this warp's rows first .. first + per_warp - 1.
    float upd[kStatePerWarp] = {};
    for (int i = 0; i < kChunk; ++i) {
      const float x = X[i * kCols + lane];
      const float* Bi = B + i * dk + first;
      if constexpr (kVec) {
#pragma unroll
        for (int r = 0; r < kStatePerWarp; r += 4) {
          if (r < per_warp) {
            const float4 b = *reinterpret_cast<const float4*>(Bi + r);
            upd[r] += b.x * x;
            upd[r + 1] += b.y * x;
            upd[r + 2] += b.z * x;
            upd[r + 3] += b.w * x;
          }
        }
      } else {
#pragma unroll
        for (int r = 0; r < kStatePerWarp; ++r) {
          if (r < per_warp && first + r < dk) upd[r] += Bi[r] * x;
        }
      }
    }
    const float decay = p.decay[chunk * p.heads + h];
#pragma unroll
    for (int r = 0; r < kStatePerWarp; ++r) {
      const int k = first + r;
      if (r < per_warp && k < dk) {
        float s = decay * S[k * kCols + lane] + p.sign_b * upd[r];
        if (p.add != nullptr && column) s += p.add[ss + (int64_t)k * p.dv + j];
        S[k * kCols + lane] = s;
      }
    }
    __syncthreads();  // S complete before the next step reads it
  }
}

bool recurrence_cuda(Recurrence& r, const Plan& plan) {
  const int64_t dk = r.a.size(-1), dv = r.base.size(-1), heads = r.base.size(1);
  const bool fits = r.base.scalar_type() == at::kFloat && dk <= kMaxDk && r.base.size(2) == kChunk &&
                    r.base.is_contiguous() && r.a.is_contiguous() && r.b.is_contiguous() && r.decay.is_contiguous() &&
                    (!r.add.defined() || r.add.is_contiguous()) && r.state_out.is_contiguous() && r.x_out.is_contiguous();
  if (!fits) return false;
  const c10::cuda::CUDAGuard guard(r.base.device());
  const size_t bytes = (dk * kCols + 4 * kChunk * dk + kChunk * kCols) * sizeof(float);
  const at::Tensor chunks_of = plan.chunks_of.to(r.base.device()), offset = plan.offset_device.to(r.base.device());
  Args p{r.base.data_ptr<float>(), r.a.data_ptr<float>(), r.b.data_ptr<float>(),
         r.add.defined() ? r.add.data_ptr<float>() : nullptr, r.decay.data_ptr<float>(),
         r.state_out.data_ptr<float>(), r.x_out.data_ptr<float>(),
         chunks_of.data_ptr<int64_t>(), offset.data_ptr<int64_t>(),
         static_cast<float>(r.sign_a), static_cast<float>(r.sign_b),
         static_cast<int>(heads), static_cast<int>(dk), static_cast<int>(dv), r.reverse};
  const dim3 grid((dv + kCols - 1) / kCols, heads, plan.documents);
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const bool vec = dk % 32 == 0 && aligned(r.a) && aligned(r.b);
  const auto kernel = vec ? recurrence_kernel<true> : recurrence_kernel<false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

const Backend<RecurrenceKernel>::Register registered(c10::DeviceType::CUDA, &recurrence_cuda);

}  // namespace
}  // namespace v4::gdr
