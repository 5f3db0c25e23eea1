// CUDA kernels of v4_mla_dsa_attention (built by tools/build_ext.py where nvcc and a CUDA torch
// exist; the ATen path in mla_dsa_attention.cc serves everywhere else).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "cc/common/backend.h"
#include "cc/common/mma_sync.cuh"
#include "cc/common/wgmma.cuh"
#include "cc/models/glm5/mla_dsa_attention.h"

namespace v4::cuda {
namespace {

// The indexer's score tile: 64 queries x 128 keys per block of 4 warps, each warp 32 x 64 as
// 2 x 8 tensor-core tiles of 16 x 8 (mma.sync m16n8k16, fp32 accumulation).
constexpr int kRows = 64, kCols = 128, kThreads = 128, kPad = 8;

// rows x dp tile of `src` (row r at src + r * stride, `cols` valid columns) into shared memory
// with row pitch dp + kPad; rows past `valid` and columns past `cols` are zero.
template <typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t stride, int rows, int valid, int cols, int dp,
                                          bool vec) {
  const int pitch = dp + kPad;
  if (vec) {  // 16-byte loads: cols % 8 == 0 and 16-byte aligned rows
    const int chunks = dp / 8;
    for (int i = threadIdx.x; i < rows * chunks; i += kThreads) {
      const int r = i / chunks, c = (i % chunks) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < valid && c < cols) v = *reinterpret_cast<const uint4*>(src + r * stride + c);
      *reinterpret_cast<uint4*>(dst + r * pitch + c) = v;
    }
  } else {
    for (int i = threadIdx.x; i < rows * dp; i += kThreads) {
      const int r = i / dp, c = i % dp;
      dst[r * pitch + c] = (r < valid && c < cols) ? src[r * stride + c] : T(0.0f);
    }
  }
}

__device__ __forceinline__ uint32_t word(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// out[i, j] = scale * sum_h w[i, h] relu(q[i, h, :] . k[j, :]) for j <= first + i, else -inf.
// q [B, n, d] (row stride q_stride, head stride d), k [Nk, d] (row stride k_stride), w [B, n] fp32.
template <typename T>
__global__ void __launch_bounds__(kThreads) indexer_scores_kernel(const T* __restrict__ q, int64_t q_stride,
                                                                  const T* __restrict__ k, int64_t k_stride,
                                                                  const float* __restrict__ w, float* __restrict__ out,
                                                                  int B, int Nk, int n, int d, int64_t first,
                                                                  float scale, bool vec) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int dp = (d + 15) / 16 * 16, pitch = dp + kPad;
  T* sK = reinterpret_cast<T*>(smem);
  T* sQ = sK + kCols * pitch;
  float* sW = reinterpret_cast<float*>(sQ + kRows * pitch);
  const int row0 = blockIdx.y * kRows, col0 = blockIdx.x * kCols;
  const int rows_valid = min(kRows, B - row0), cols_valid = min(kCols, Nk - col0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wr = (warp / 2) * 32, wc = (warp % 2) * 64;  // the warp's corner in the tile
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  if (col0 > first + row0 + rows_valid - 1) {  // every key of the tile is after every query
    for (int i = threadIdx.x; i < rows_valid * cols_valid; i += kThreads)
      out[(row0 + i / cols_valid) * int64_t(Nk) + col0 + i % cols_valid] = kNegInf;
    return;
  }
  load_tile(sK, k + col0 * k_stride, k_stride, kCols, cols_valid, d, dp, vec);
  for (int i = threadIdx.x; i < kRows * n; i += kThreads)
    sW[i] = (i / n < rows_valid) ? w[(row0 + i / n) * int64_t(n) + i % n] * scale : 0.0f;

  float acc[2][8][4] = {};
  for (int h = 0; h < n; ++h) {
    __syncthreads();  // the previous head's sQ is read
    load_tile(sQ, q + row0 * q_stride + h * d, q_stride, kRows, rows_valid, d, dp, vec);
    __syncthreads();
    float s[2][8][4] = {};
    for (int kk = 0; kk < dp; kk += 16) {
      uint32_t a[2][4], b[8][2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const T* base = sQ + (wr + m * 16 + g) * pitch + kk + 2 * t;
        a[m][0] = word(base);
        a[m][1] = word(base + 8 * pitch);
        a[m][2] = word(base + 8);
        a[m][3] = word(base + 8 * pitch + 8);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const T* base = sK + (wc + j * 8 + g) * pitch + kk + 2 * t;
        b[j][0] = word(base);
        b[j][1] = word(base + 8);
      }
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j) mma16816<T>(s[m][j], a[m], b[j]);
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float w0 = sW[(wr + m * 16 + g) * n + h], w1 = sW[(wr + m * 16 + g + 8) * n + h];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[m][j][0] += w0 * fmaxf(s[m][j][0], 0.0f);
        acc[m][j][1] += w0 * fmaxf(s[m][j][1], 0.0f);
        acc[m][j][2] += w1 * fmaxf(s[m][j][2], 0.0f);
        acc[m][j][3] += w1 * fmaxf(s[m][j][3], 0.0f);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wr + m * 16 + g + (e >= 2 ? 8 : 0), c = wc + j * 8 + 2 * t + (e & 1);
        if (r < rows_valid && c < cols_valid)
          out[(row0 + r) * int64_t(Nk) + col0 + c] = (col0 + c > first + row0 + r) ? kNegInf : acc[m][j][e];
      }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- Sparse latent attention: one block per query and 64 heads; 8 warps; the selected keys in
// tiles of 32, gathered into shared memory with cp.async one tile ahead of the math.
constexpr int kHeads = 64, kKeys = 32, kWarps = 8, kSparseThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

using wgmma::cp_async16;  // the gathers copy with cp.async (wgmma.cuh)
using wgmma::cp_async_commit;
using wgmma::cp_async_wait;

// A row's max and sum over the 4 lanes of a quad (those holding one row of an mma fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Online softmax's step for a row (scores in log2 units): the running max m takes the tile's max,
// alpha rescales the sums so far, and the result is the base the tile's exponentials subtract
// (0 while no score is finite, so that a row of -inf gives 0, not NaN).
__device__ __forceinline__ float online_step(float& m, float tile_max, float& alpha) {
  const float m_new = fmaxf(m, tile_max), base = m_new == -std::numeric_limits<float>::infinity() ? 0.0f : m_new;
  alpha = exp2f(m - base);
  m = m_new;
  return base;
}

// Shapes of one launch. dp: D rounded up to 32 (a warp's half of the columns is whole 16-column
// steps); rows of shared tiles are dp + 8 wide (16-byte aligned rows, no ldmatrix bank conflicts).
struct SparseShape {
  int Lq, nh, D, C, K, dp, cp;  // cp: C rounded up to 32
  __host__ __device__ int pitch() const { return dp + 8; }
};

// 64 rows (heads row0..) of a [rows, width] matrix at src (row stride `stride`, a multiple of 8)
// into dst (pitch `pitch`), zero past `valid` rows and past `width` columns up to `cols`.
template <typename T>
__device__ __forceinline__ void load_rows_async(T* dst, int pitch, const T* src, int64_t stride, int width, int valid,
                                                int cols) {
  const int chunks = cols / 8;
  for (int i = threadIdx.x; i < kHeads * chunks; i += kSparseThreads) {
    const int r = i / chunks, c = (i % chunks) * 8;
    const bool ok = r < valid && c < width;
    cp_async16(dst + r * pitch + c, ok ? src + r * stride + c : src, ok);
  }
}

// The key id of selection slot `slot` of a query (its row of idx), -1 past the K slots.
__device__ __forceinline__ int key_id(const int64_t* idx_row, int K, int slot) {
  return slot < K ? int(idx_row[slot]) : -1;
}

// Key tile `tile` (slots tile*32..): rows of kv named by ids (read from shared memory, so that no
// gather waits on a global load of its index), zero for unused slots (-1).
template <typename T>
__device__ __forceinline__ void load_keys_async(T* dst, const int* ids, const T* kv, const SparseShape& s) {
  const int chunks = s.dp / 8, pitch = s.pitch();
  for (int i = threadIdx.x; i < kKeys * chunks; i += kSparseThreads) {
    const int r = i / chunks, c = (i % chunks) * 8, key = ids[r];
    const bool ok = key >= 0 && c < s.D;
    cp_async16(dst + r * pitch + c, ok ? kv + int64_t(key) * s.D + c : kv, ok);
  }
}

// The key tiles of query t, double-buffered in sK [2][kKeys][pitch]: tile i + 1 is gathered
// (cp.async) while body(keys, key ids) computes on tile i. The key ids sit in sKey [3][kKeys], a
// ring written two tiles ahead: each tile's index loads are in flight during the tile before.
// Loads issued before the call and not yet committed (the query's own rows) arrive with tile 0.
template <typename T, typename Body>
__device__ __forceinline__ void for_each_key_tile(T* sK, int* sKey, const T* kv, const int64_t* idx,
                                                  const SparseShape& s, int t, Body&& body) {
  const int pitch = s.pitch(), tiles = (s.K + kKeys - 1) / kKeys;
  const int64_t* row = idx + int64_t(t) * s.K;
  if (threadIdx.x < kKeys) {
    sKey[threadIdx.x] = key_id(row, s.K, threadIdx.x);
    sKey[kKeys + threadIdx.x] = key_id(row, s.K, kKeys + threadIdx.x);
  }
  __syncthreads();
  load_keys_async(sK, sKey, kv, s);
  cp_async_commit();
  for (int i = 0; i < tiles; ++i) {
    const int buf = i % 2;
    const int ahead = threadIdx.x < kKeys ? key_id(row, s.K, (i + 2) * kKeys + threadIdx.x) : -1;
    if (i + 1 < tiles) {
      load_keys_async(sK + (buf ^ 1) * kKeys * pitch, sKey + (i + 1) % 3 * kKeys, kv, s);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    body(static_cast<const T*>(sK + buf * kKeys * pitch), static_cast<const int*>(sKey + i % 3 * kKeys));
    if (threadIdx.x < kKeys) sKey[(i + 2) % 3 * kKeys + threadIdx.x] = ahead;  // tile i - 1's slot: read
    __syncthreads();  // the body's shared tiles and this buffer are rewritten next
  }
}

// S (16 rows of warp row group wr, 16 keys from column kc) = A [rows, dims] . B[keys, dims]^T over
// `depth` dims, both row-major in shared memory.
template <typename T>
__device__ __forceinline__ void scores16(float (&s)[2][4], const T* a, int a_pitch, const T* b, int b_pitch,
                                         int depth, int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
  // Unrolled so that the next steps' fragment loads issue while this step's products run.
#pragma unroll 4
  for (int kk = 0; kk < depth; kk += 16) {
    uint32_t af[4], bf[4];
    ldsm_x4(af, a + (lane % 16) * a_pitch + kk + (lane / 16) * 8);
    ldsm_x4(bf, b + ((lane / 16) * 8 + lane % 8) * b_pitch + kk + ((lane / 8) % 2) * 8);
    mma16816<T>(s[0], af, {bf[0], bf[1]});
    mma16816<T>(s[1], af, {bf[2], bf[3]});
  }
}

// acc[j] += A (16 rows x 32 keys, as fragments a[2]) . B[keys, cols col0 + 8j ..] (B row-major
// [keys, cols] in shared memory, read transposed), for the `cols` columns from col0 (j < NT).
template <typename T, int NT>
__device__ __forceinline__ void accumulate_pv(float (&acc)[NT][4], const uint32_t (&a)[2][4], const T* b, int pitch,
                                              int col0, int cols, int lane) {
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      if (j * 8 >= cols) break;
      uint32_t bf[4];
      ldsm_x4_t(bf, b + (ks * 16 + lane % 8 + ((lane / 8) % 2) * 8) * pitch + col0 + j * 8 + (lane / 16) * 8);
      mma16816<T>(acc[j], a[ks], {bf[0], bf[1]});
      mma16816<T>(acc[j + 1], a[ks], {bf[2], bf[3]});
    }
}

// o[t, h] = softmax_j(scale q[t, h] . kv[idx[t, j]]) kv[idx[t, j], :C]; lse[t, h] natural log.
// Warp w: rows 16 (w % 4).., scores of keys 16 (w / 4).. of each tile, output columns
// (w / 4) * cp / 2 .. of C. NT = cp / 16 output tiles of 8 columns per warp.
template <typename T, int NT>
__global__ void __launch_bounds__(kSparseThreads, 1)
    sparse_forward_kernel(const T* __restrict__ q, const T* __restrict__ kv, const int64_t* __restrict__ idx,
                          T* __restrict__ o, float* __restrict__ lse, SparseShape s, float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int pitch = s.pitch(), t = blockIdx.x, row0 = blockIdx.y * kHeads, valid = min(kHeads, s.nh - row0);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kHeads * pitch;                                          // [2][kKeys][pitch]
  float* sS = reinterpret_cast<float*>(sK + 2 * kKeys * pitch);       // [kHeads][kKeys + 4]
  int* sKey = reinterpret_cast<int*>(sS + kHeads * (kKeys + 4));       // [3][kKeys]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const int wr = (warp % 4) * 16, kc = (warp / 4) * 16, oc = (warp / 4) * (s.cp / 2);
  const float sl2 = scale * kLog2e;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  load_rows_async(sQ, pitch, q + (int64_t(t) * s.nh + row0) * s.D, s.D, s.D, valid, s.dp);
  float acc[NT][4] = {}, m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  for_each_key_tile(sK, sKey, kv, idx, s, t, [&](const T* keys, const int* key_ids) {
    float sc[2][4];
    scores16(sc, sQ + wr * pitch, pitch, keys + kc * pitch, pitch, s.dp, lane);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kc + j * 8 + 2 * tq + (e & 1), row = wr + g + (e >= 2 ? 8 : 0);
        sS[row * (kKeys + 4) + key] = key_ids[key] >= 0 ? sc[j][e] * sl2 : kNegInf;
      }
    __syncthreads();
    // Online softmax over this tile's 32 keys for rows g and g + 8 (the 4 lanes of a group hold a row).
    float p[4][4], mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[j][e] = sS[(wr + g + (e >= 2 ? 8 : 0)) * (kKeys + 4) + j * 8 + 2 * tq + (e & 1)];
        mx[e / 2] = fmaxf(mx[e / 2], p[j][e]);
      }
    float alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int x = 0; x < 2; ++x) mx[x] = online_step(m[x], quad_max(mx[x]), alpha[x]);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[j][e] = exp2f(p[j][e] - mx[e / 2]);
        sum[e / 2] += p[j][e];
      }
#pragma unroll
    for (int x = 0; x < 2; ++x) l[x] = l[x] * alpha[x] + quad_sum(sum[x]);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }
    uint32_t a[2][4];
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      a[ks][0] = pack2<T>(p[2 * ks][0], p[2 * ks][1]);
      a[ks][1] = pack2<T>(p[2 * ks][2], p[2 * ks][3]);
      a[ks][2] = pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]);
      a[ks][3] = pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3]);
    }
    accumulate_pv<T, NT>(acc, a, keys, pitch, oc, s.cp / 2, lane);
  });
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int row = wr + g + 8 * x;
    if (row >= valid) continue;
    const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;
    T* out = o + (int64_t(t) * s.nh + row0 + row) * s.C;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = oc + j * 8 + 2 * tq;
      if (j * 8 < s.cp / 2 && col < s.C) *reinterpret_cast<uint32_t*>(out + col) = pack2<T>(acc[j][2 * x] * inv, acc[j][2 * x + 1] * inv);
    }
    if (tq == 0 && warp < 4) lse[int64_t(t) * s.nh + row0 + row] = l[x] > 0.0f ? (m[x] + log2f(l[x])) * kLn2 : kNegInf;
  }
}

// ---- The forward at GLM-5's widths (D = 576 latent + rope dims, C = 512 value dims) on Hopper's
// warpgroup products, warp-specialised as FlashMLA's sparse prefill arranges it: a block a query
// and 64 heads, three warpgroups. Warpgroup 2 only gathers: two 64-key blocks in flight (buffers 0
// and 1), each buffer in halves L (columns 0-255) and R (256-575) with their own "ready" and "done"
// barriers, so a half is refilled as soon as its readers are done. Warpgroup 0 takes the even
// blocks and output columns 0-255, warpgroup 1 the odd blocks and columns 256-511. Each forms its
// block's scores (S = Q K^T, m64n64) and softmax, then O[:, its half] += P V over its own block (P
// from registers) and over the other's (P from shared memory), so one's scores and softmax run
// while the other's products are in flight. The running max passes 0 -> 1 -> 0 through shared
// memory (block b's softmax starts from block b - 1's max); warpgroup 0 rescales its P to block
// b + 1's max before sharing it, so both add the other's P as it lies. Shared tiles are in the
// 128-byte swizzled layout (cc/common/wgmma.cuh's sw128_offset): 8 gathering threads copy a key's
// 128 contiguous bytes into one row of a 64-column block, whole L2 sectors in and no bank
// conflict. Warpgroup 0's P (even blocks) sits on buffer 0's rope columns (512-575), dead once
// its scores are formed; warpgroup 1's in a tile of its own. A consumer reads the other's buffer
// half without waiting on its "ready" barrier: the other waited on it, and hands the block over
// after its scores (kMax0 / kMax1, then kP0 / kP1).
constexpr int kWgD = 576, kWgC = 512, kWgKeys = 64, kWgThreads = 256, kFwdThreads = 384;
constexpr int kWgTileBytes = kHeads * kWgD * 2;       // Q's tile and each key buffer: 64 rows x 576
constexpr int kRopeBytes = kHeads * (kWgD - kWgC) * 2;  // columns 512-575: 64 x 64, P's size

// Shared memory of the forward: Q, two key buffers, warpgroup 1's P, then the maxima [64], the row
// sums [2][64], the key slots' validity [2][64] and nine barriers (Q; ready and done of 2 x 2 halves).
// (+1,024: the swizzled tiles start on 1,024 bytes.)
size_t wgmma_forward_smem() {
  return 3 * size_t(kWgTileBytes) + kRopeBytes + (kHeads + 2 * kHeads + 2 * kWgKeys) * 4 + 9 * 8 + 1024;
}

// Named barriers (0 is __syncthreads): the maxima and P handed between the consumer warpgroups.
enum FwdBarrier { kMax0 = 1, kMax1, kP0, kP1, kSums };

// A thread's share of 64-column blocks [From, To) of a swizzled 64-row tile copied by Threads
// threads: rows (Threads / 8) i + p / 8 of thread p, its chunk p % 8 of each block (8 threads copy a
// row's 128 contiguous bytes), from src[i] (nullptr: zeros; any_row is a readable address for the
// zero-byte copies).
template <int Threads, int From, int To, typename T>
__device__ __forceinline__ void gather_blocks(unsigned char* dst, const T* const (&src)[64 * 8 / Threads], const T* any_row) {
  const int p = threadIdx.x % Threads, chunk = p % 8;
#pragma unroll
  for (int i = 0; i < 64 * 8 / Threads; ++i) {
    unsigned char* d = dst + wgmma::sw128_offset<64>(Threads / 8 * i + p / 8, 8 * chunk);
#pragma unroll
    for (int b = From; b < To; ++b)
      cp_async16(d + b * 8192, src[i] ? src[i] + 64 * b + 8 * chunk : any_row, src[i] != nullptr);
  }
}

template <typename T>
__global__ void __launch_bounds__(kFwdThreads, 1)
    sparse_forward_wgmma_kernel(const T* __restrict__ q, const T* __restrict__ kv, const int64_t* __restrict__ idx,
                                T* __restrict__ o, float* __restrict__ lse, int nh, int K, float scale) {
#if defined(V4_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = wgmma::sw128_aligned(smem_raw);
  unsigned char* sQ = smem;
  unsigned char* sK = smem + kWgTileBytes;  // [2] key buffers
  unsigned char* sP1 = smem + 3 * kWgTileBytes;
  float* sM = reinterpret_cast<float*>(sP1 + kRopeBytes);  // [64]
  float* sL = sM + kHeads;                                 // [2][64]
  int* sValid = reinterpret_cast<int*>(sL + 2 * kHeads);   // [2][64]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sValid + 2 * kWgKeys);
  uint64_t* bar_q = bars;
  const auto ready = [&](int buf, int half) { return bars + 1 + 2 * buf + half; };
  const auto done = [&](int buf, int half) { return bars + 5 + 2 * buf + half; };
  const int t = blockIdx.x, row0 = blockIdx.y * kHeads, valid = min(kHeads, nh - row0);
  // (read through a shuffle: the compiler then knows it is one value a warp, and does not
  // serialise the warpgroups' products as if their branches diverged)
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0), rounds = ((K + kWgKeys - 1) / kWgKeys + 1) / 2;
  if (threadIdx.x == 0) {
    wgmma::bar_init(bar_q, 128);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        // The half each consumer reads first also carries its blocks' validity: 128 more arrivals.
        wgmma::bar_init(ready(b, h), b == h ? 256 : 128);
        wgmma::bar_init(done(b, h), 128);
      }
    wgmma::bar_init_fence();
  }
  __syncthreads();

  if (wg == 2) {  // ---- the gather
    wgmma::regs_shrink<72>();
    const int p = threadIdx.x % 128;
    const int64_t* ids = idx + int64_t(t) * K;
    // This thread's rows 16i + p / 8 of block b: their key rows of kv (nullptr for unused slots).
    const auto key_rows = [&](int b, const T* (&rows)[4]) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key_id(ids, K, b * kWgKeys + 16 * i + p / 8);
        rows[i] = key >= 0 ? kv + int64_t(key) * kWgD : nullptr;
      }
    };
    // The validity of this thread's rows (one writer a row) goes with the half its consumer reads first.
    const auto mark = [&](int* ok, const T* const (&rows)[4]) {
      if (p % 8 == 0)
#pragma unroll
        for (int i = 0; i < 4; ++i) ok[16 * i + p / 8] = rows[i] != nullptr;
    };
    const T* q_rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * i + p / 8;
      q_rows[i] = row < valid ? q + (int64_t(t) * nh + row0 + row) * kWgD : nullptr;
    }
    gather_blocks<128, 0, kWgD / 64>(sQ, q_rows, q);
    wgmma::bar_arrive_copies(bar_q);
    const T *k0[4], *k1[4];
    unsigned char* b0 = sK;
    unsigned char* b1 = sK + kWgTileBytes;
    for (int r = 0; r < rounds; ++r) {
      const int parity = (r & 1) ^ 1;
      key_rows(2 * r, k0);
      key_rows(2 * r + 1, k1);
      wgmma::bar_wait(done(0, 0), parity);  // in the order the consumers read them
      mark(sValid, k0);
      gather_blocks<128, 0, 4>(b0, k0, kv);
      wgmma::bar_arrive_copies(ready(0, 0));
      wgmma::bar_arrive(ready(0, 0));
      wgmma::bar_wait(done(1, 1), parity);
      mark(sValid + kWgKeys, k1);
      gather_blocks<128, 4, kWgD / 64>(b1, k1, kv);
      wgmma::bar_arrive_copies(ready(1, 1));
      wgmma::bar_arrive(ready(1, 1));
      wgmma::bar_wait(done(0, 1), parity);
      gather_blocks<128, 4, kWgD / 64>(b0, k0, kv);
      wgmma::bar_arrive_copies(ready(0, 1));
      wgmma::bar_wait(done(1, 0), parity);
      gather_blocks<128, 0, 4>(b1, k1, kv);
      wgmma::bar_arrive_copies(ready(1, 0));
    }
    return;
  }

  // ---- the consumers: warpgroup wg, blocks of parity wg, output columns 256wg..
  wgmma::regs_grow<216>();
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4, r0 = 16 * warp + g;
  const float sl2 = scale * kLog2e;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const uint32_t q_addr = wgmma::saddr(sQ), own = wgmma::saddr(sK + wg * kWgTileBytes),
                 other = wgmma::saddr(sK + (1 - wg) * kWgTileBytes);
  // Warpgroup 0's P goes to its buffer's rope columns, warpgroup 1's to sP1.
  unsigned char* sP_own = wg == 0 ? sK + kWgTileBytes - kRopeBytes : sP1;
  const uint32_t p_other = wg == 0 ? wgmma::saddr(sP1) : wgmma::saddr(sK + kWgTileBytes - kRopeBytes);
  float o_acc[128] = {}, s[32], m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  uint32_t p[16];
  // S = Q K^T over columns [16 From, 16 To) of this warpgroup's buffer, once that half is in.
  const auto scores = [&](int half, int parity, auto from, auto to) {
    wgmma::bar_wait(ready(wg, half), parity);
    wgmma::fence_shared();
    wgmma::fence();
    const uint64_t q_desc = wgmma::desc128(q_addr, 16, 1024), k_desc = wgmma::desc128(own, 16, 1024);
#pragma unroll 1
    for (int kk = decltype(from)::value; kk < decltype(to)::value; ++kk) {
      const int step = wgmma::sw128_k_step<64>(kk) / 16;  // in the descriptor's 16-byte units
      wgmma::mma<T, 64>(s, q_desc + step, k_desc + step);
    }
    wgmma::commit();
  };
  using L0 = std::integral_constant<int, 0>;
  using L16 = std::integral_constant<int, 16>;
  using L36 = std::integral_constant<int, kWgD / 16>;
  const auto clear_scores = [&] {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
  };
  // The scores of slots that name no key (-1) are -inf; the rest scaled to log2 units. Returns
  // this block's max of rows r0 and r0 + 8.
  const auto mask = [&](float (&mx)[2]) {
    const int* ok = sValid + wg * kWgKeys;
    mx[0] = mx[1] = kNegInf;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = ok[8 * j + 2 * tq + (e & 1)] ? s[4 * j + e] * sl2 : kNegInf;
        mx[e / 2] = fmaxf(mx[e / 2], s[4 * j + e]);
      }
    mx[0] = quad_max(mx[0]);
    mx[1] = quad_max(mx[1]);
  };
  // Online softmax of this block, its rows' max taken as `start` (warpgroup 1: with block b's max
  // folded in): O and l rescaled, s holds P (float), p as pairs.
  const auto softmax = [&](const float (&start)[2]) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float alpha;
      const float base = online_step(m[x], start[x], alpha);
      l[x] *= alpha;
#pragma unroll
      for (int j = 0; j < 32; ++j) o_acc[4 * j + 2 * x] *= alpha, o_acc[4 * j + 2 * x + 1] *= alpha;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[4 * j + 2 * x] = exp2f(s[4 * j + 2 * x] - base);
        s[4 * j + 2 * x + 1] = exp2f(s[4 * j + 2 * x + 1] - base);
        l[x] += s[4 * j + 2 * x] + s[4 * j + 2 * x + 1];
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) p[i] = pack2<T>(s[2 * i], s[2 * i + 1]);
  };
  const auto store_p = [&] {
#pragma unroll
    for (int i = 0; i < 16; ++i)  // p[i]: row r0 + 8 (i % 2), keys 8 (i / 2) + 2 tq
      *reinterpret_cast<uint32_t*>(sP_own + wgmma::sw128_offset<64>(r0 + 8 * (i % 2), 8 * (i / 2) + 2 * tq)) = p[i];
    wgmma::fence_shared();
  };
  // O[:, 256 wg..] += P V: own P from registers, the other's from shared memory.
  const auto pv_own = [&] {
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk)
      wgmma::mma_rs<T>(o_acc, p + 4 * kk, wgmma::desc128(own + wg * 4 * 8192 + kk * 2048, 8192, 1024));
    wgmma::commit();
  };
  const auto pv_other = [&] {
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk)
      wgmma::mma<T, 256, 0, 1>(o_acc, wgmma::desc128(p_other + kk * 32, 16, 1024),
                                wgmma::desc128(other + wg * 4 * 8192 + kk * 2048, 8192, 1024));
    wgmma::commit();
  };

  wgmma::bar_wait(bar_q, 0);
  if (wg == 0) {
    clear_scores();
    scores(0, 0, L0{}, L16{});
    scores(1, 0, L16{}, L36{});
    wgmma::wait<0>();
    wgmma::fence_operand(s);
    for (int r = 0; r < rounds; ++r) {
      const int parity = r & 1;
      float mx[2];
      mask(mx);
      softmax(mx);
      if (tq == 0) sM[r0] = m[0], sM[r0 + 8] = m[1];
      wgmma::named_arrive(kMax0, 256);
      pv_own();
      wgmma::wait<0>();
      wgmma::fence_operand(o_acc);
      wgmma::bar_arrive(done(0, 0));
      wgmma::named_sync(kMax1, 256);  // block b + 1's max is in
      float factor[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const float next = sM[r0 + 8 * x];
        factor[x] = next == kNegInf ? 1.0f : exp2f(m[x] - next);  // m = -inf < next: 0
        m[x] = next;
        l[x] *= factor[x];
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) p[i] = pack2<T>(s[2 * i] * factor[i % 2], s[2 * i + 1] * factor[i % 2]);
      store_p();
      wgmma::named_arrive(kP0, 256);
#pragma unroll
      for (int j = 0; j < 64; ++j) o_acc[2 * j] *= factor[j % 2], o_acc[2 * j + 1] *= factor[j % 2];
      wgmma::named_sync(kP1, 256);  // warpgroup 1's P is in
      pv_other();
      if (r + 1 < rounds) {
        clear_scores();
        scores(0, parity ^ 1, L0{}, L16{});
        wgmma::wait<1>();
        wgmma::fence_operand(o_acc);
        wgmma::bar_arrive(done(1, 0));
        scores(1, parity ^ 1, L16{}, L36{});
        wgmma::wait<0>();
        wgmma::fence_operand(s);
      } else {
        wgmma::wait<0>();
        wgmma::fence_operand(o_acc);
        wgmma::bar_arrive(done(1, 0));
      }
    }
  } else {
    for (int r = 0; r < rounds; ++r) {
      const int parity = r & 1;
      clear_scores();
      scores(1, parity, L16{}, L36{});
      scores(0, parity, L0{}, L16{});
      wgmma::wait<0>();
      wgmma::fence_operand(s);
      float mx[2];
      mask(mx);
      wgmma::named_sync(kMax0, 256);  // block b's max is in
      mx[0] = fmaxf(mx[0], sM[r0]);
      mx[1] = fmaxf(mx[1], sM[r0 + 8]);
      __syncwarp();  // read before lane tq = 0 writes the row's new max below
      softmax(mx);
      if (tq == 0) sM[r0] = m[0], sM[r0 + 8] = m[1];
      wgmma::named_arrive(kMax1, 256);
      store_p();  // (first: an in-flight product's register operand may not be read)
      pv_own();
      wgmma::named_sync(kP0, 256);  // warpgroup 0's P, at this block's max, is in
      pv_other();
      wgmma::named_arrive(kP1, 256);
      wgmma::wait<1>();
      wgmma::bar_arrive(done(1, 1));
      wgmma::wait<0>();
      wgmma::fence_operand(o_acc);
      wgmma::bar_arrive(done(0, 1));
    }
  }
  // l: this warpgroup's blocks' share of each row, both at the last block's max.
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    l[x] = quad_sum(l[x]);
    if (tq == 0) sL[wg * kHeads + r0 + 8 * x] = l[x];
  }
  wgmma::named_sync(kSums, 256);
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int row = r0 + 8 * x;
    if (row >= valid) continue;
    const float total = l[x] + sL[(1 - wg) * kHeads + row], inv = total > 0.0f ? 1.0f / total : 0.0f;
    T* out = o + (int64_t(t) * nh + row0 + row) * kWgC + wg * 256;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<uint32_t*>(out + 8 * j + 2 * tq) =
          pack2<T>(o_acc[4 * j + 2 * x] * inv, o_acc[4 * j + 2 * x + 1] * inv);
    if (tq == 0 && wg == 0)
      lse[int64_t(t) * nh + row0 + row] = total > 0.0f ? (m[x] + log2f(total)) * kLn2 : kNegInf;
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// ---- The backward at GLM-5's widths on wgmma: a block a query and 64 heads, two warpgroups, one
// 64-key tile at a time (shared memory holds Q, dout and one key tile: 230 KB). Warpgroup w forms
// the scores S and dP = dout V^T of keys 32w.. (m64n32), writes P and dS = P (dP - delta) scale
// into shared tiles, then dq[:, 256w..] and dq[:, 512 + 32w..] += dS K (dq's 144 registers a
// thread live across the tiles). Once both warpgroups are past the key tile the next tile's gather
// starts, while each forms dkv's column chunks (dS^T Q + P^T dout, both operands read MN-major)
// and adds them to dkv with atomics. Tiles in the 128-byte swizzled layout, as the forward's.
constexpr int kWgDoutBytes = kHeads * kWgC * 2;  // dout's tile: 64 rows x 512

size_t wgmma_backward_smem() {  // (+1,024: the swizzled tiles start on 1,024 bytes)
  return 2 * size_t(kWgTileBytes) + kWgDoutBytes + 2 * kHeads * kWgKeys * 2 + 2 * kHeads * 4 + 3 * kWgKeys * 4 + 1024;
}

// dkv[ids[r], col..] += the warpgroup accumulator's rows r0, r0 + 8 (keys of the tile; N columns)
// as float2 atomics; unused slots (-1) add nothing.
template <int N>
__device__ __forceinline__ void add_key_rows(float* dkv, const int* ids, const float (&acc)[N / 2], int col, int r0,
                                             int tq) {
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int key = ids[r0 + 8 * x];
    if (key < 0) continue;
    float* out = dkv + int64_t(key) * kWgD + col + 2 * tq;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
      atomicAdd(reinterpret_cast<float2*>(out + 8 * j), make_float2(acc[4 * j + 2 * x], acc[4 * j + 2 * x + 1]));
  }
  __syncwarp();  // the warp converged again before the next wgmma.fence (.sync.aligned)
}

template <typename T>
__global__ void __launch_bounds__(kWgThreads, 1)
    sparse_backward_wgmma_kernel(const T* __restrict__ q, const T* __restrict__ kv, const int64_t* __restrict__ idx,
                                 const T* __restrict__ dout, longlong2 dout_stride, const float* __restrict__ lse,
                                 const float* __restrict__ delta, T* __restrict__ dq, float* __restrict__ dkv, int nh,
                                 int K, float scale) {
#if defined(V4_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sQ = wgmma::sw128_aligned(smem_raw);
  unsigned char* sK = sQ + kWgTileBytes;
  unsigned char* sO = sK + kWgTileBytes;                    // dout
  unsigned char* sP = sO + kWgDoutBytes;                    // [64 heads x 64 keys]
  unsigned char* sS = sP + kHeads * kWgKeys * 2;            // dS, the same
  float* sStat = reinterpret_cast<float*>(sS + kHeads * kWgKeys * 2);  // lse log2e, delta: [2][64]
  int* sKey = reinterpret_cast<int*>(sStat + 2 * kHeads);              // [3][64], a ring
  const int t = blockIdx.x, row0 = blockIdx.y * kHeads, valid = min(kHeads, nh - row0);
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, r0 = 16 * warp + lane / 4,
            tq = lane % 4;
  const float sl2 = scale * kLog2e;
  const int tiles = (K + kWgKeys - 1) / kWgKeys;
  const int64_t* row = idx + int64_t(t) * K;
  const uint32_t q_addr = wgmma::saddr(sQ), k_addr = wgmma::saddr(sK), o_addr = wgmma::saddr(sO), p_addr = wgmma::saddr(sP),
                 s_addr = wgmma::saddr(sS);
  const int hr = threadIdx.x / 8;  // this thread's rows hr and 32 + hr of each tile it copies
  const auto load_keys = [&](int tile) {
    const T* rows[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int key = sKey[tile % 3 * kWgKeys + 32 * i + hr];
      rows[i] = key >= 0 ? kv + int64_t(key) * kWgD : nullptr;
    }
    gather_blocks<kWgThreads, 0, kWgD / 64>(sK, rows, kv);
  };

  if (threadIdx.x < kWgKeys) {
    sKey[threadIdx.x] = key_id(row, K, threadIdx.x);
    sKey[kWgKeys + threadIdx.x] = key_id(row, K, kWgKeys + threadIdx.x);
  }
  if (threadIdx.x < kHeads) {
    const int64_t r = int64_t(t) * nh + row0 + threadIdx.x;
    const bool ok = int(threadIdx.x) < valid;
    sStat[threadIdx.x] = ok ? lse[r] * kLog2e : std::numeric_limits<float>::infinity();  // p = 0 on padding rows
    sStat[kHeads + threadIdx.x] = ok ? delta[r] : 0.0f;
  }
  __syncthreads();
  {
    const T *q_rows[2], *o_rows[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int head = 32 * i + hr;
      q_rows[i] = head < valid ? q + (int64_t(t) * nh + row0 + head) * kWgD : nullptr;
      o_rows[i] = head < valid ? dout + t * dout_stride.x + (row0 + head) * dout_stride.y : nullptr;
    }
    gather_blocks<kWgThreads, 0, kWgD / 64>(sQ, q_rows, q);
    gather_blocks<kWgThreads, 0, kWgC / 64>(sO, o_rows, dout);
  }
  load_keys(0);
  cp_async_commit();
  float dqa[128] = {}, dqb[16] = {};  // dq's columns 256w.. and 512 + 32w..
  for (int i = 0; i < tiles; ++i) {
    const int ahead = threadIdx.x < kWgKeys ? key_id(row, K, (i + 2) * kWgKeys + threadIdx.x) : -1;
    cp_async_wait<0>();
    wgmma::fence_shared();
    __syncthreads();  // tile i is in; tile i - 1's P, dS and ids are read
    const int* ids = sKey + i % 3 * kWgKeys;
    float sc[16], dp[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) sc[j] = dp[j] = 0.0f;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kWgD / 16; ++kk)  // S: Q's columns 16kk.. against keys 32w..
      wgmma::mma<T, 32>(sc, wgmma::desc128(q_addr + wgmma::sw128_k_step<64>(kk), 16, 1024),
                        wgmma::desc128(k_addr + wg * 4096 + wgmma::sw128_k_step<64>(kk), 16, 1024));
#pragma unroll
    for (int kk = 0; kk < kWgC / 16; ++kk)  // dP: dout's columns 16kk.. against the same keys' values
      wgmma::mma<T, 32>(dp, wgmma::desc128(o_addr + wgmma::sw128_k_step<64>(kk), 16, 1024),
                        wgmma::desc128(k_addr + wg * 4096 + wgmma::sw128_k_step<64>(kk), 16, 1024));
    wgmma::commit();
    wgmma::wait<0>();
    if (threadIdx.x < kWgKeys) sKey[(i + 2) % 3 * kWgKeys + threadIdx.x] = ahead;  // tile i - 1's slot
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int key = wg * 32 + 8 * j + 2 * tq, head = r0 + 8 * x;
        float pv[2], ds[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pv[e] = ids[key + e] >= 0 ? exp2f(sc[4 * j + 2 * x + e] * sl2 - sStat[head]) : 0.0f;
          ds[e] = pv[e] * (dp[4 * j + 2 * x + e] - sStat[kHeads + head]) * scale;
        }
        *reinterpret_cast<uint32_t*>(sP + wgmma::sw128_offset<64>(head, key)) = pack2<T>(pv[0], pv[1]);
        *reinterpret_cast<uint32_t*>(sS + wgmma::sw128_offset<64>(head, key)) = pack2<T>(ds[0], ds[1]);
      }
    wgmma::fence_shared();
    __syncthreads();  // P and dS of both warpgroups are in
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk) {  // dq += dS (keys 16kk..) . K (those keys' rows)
      const uint64_t a = wgmma::desc128(s_addr + kk * 32, 16, 1024);
      wgmma::mma<T, 256, 0, 1>(dqa, a, wgmma::desc128(k_addr + 4 * wg * 8192 + kk * 2048, 8192, 1024));
      // (the rope block's half w starts 64 bytes into its rows for w = 1)
      wgmma::mma<T, 32, 0, 1>(dqb, a, wgmma::desc128(k_addr + 8 * 8192 + 64 * wg + kk * 2048, 8192, 1024));
    }
    wgmma::commit();
    wgmma::wait<0>();
    __syncthreads();  // both warpgroups are past the key tile
    if (i + 1 < tiles) {
      load_keys(i + 1);
      cp_async_commit();
    }
    // dkv's value columns in chunks of 64 (chunk 2cc + w by warpgroup w), then its rope columns
    // 512 + 32w..: the same control flow in both warpgroups (wgmma stays asynchronous).
    for (int cc = 0; cc < kWgC / 128; ++cc) {
      const int c = 2 * cc + wg;
      float acc[32];
#pragma unroll
      for (int j = 0; j < 32; ++j) acc[j] = 0.0f;
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kHeads / 16; ++kk) {  // dS^T Q + P^T dout over heads 16kk..
        wgmma::mma<T, 64, 1, 1>(acc, wgmma::desc128(s_addr + kk * 2048, 8192, 1024),
                                wgmma::desc128(q_addr + c * 8192 + kk * 2048, 8192, 1024));
        wgmma::mma<T, 64, 1, 1>(acc, wgmma::desc128(p_addr + kk * 2048, 8192, 1024),
                                wgmma::desc128(o_addr + c * 8192 + kk * 2048, 8192, 1024));
      }
      wgmma::commit();
      wgmma::wait<0>();
      add_key_rows<64>(dkv, ids, acc, 64 * c, r0, tq);
    }
    float rope[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) rope[j] = 0.0f;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kHeads / 16; ++kk)
      wgmma::mma<T, 32, 1, 1>(rope, wgmma::desc128(s_addr + kk * 2048, 8192, 1024),
                              wgmma::desc128(q_addr + 8 * 8192 + 64 * wg + kk * 2048, 8192, 1024));
    wgmma::commit();
    wgmma::wait<0>();
    add_key_rows<32>(dkv, ids, rope, kWgC + 32 * wg, r0, tq);
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int head = r0 + 8 * x;
    if (head >= valid) continue;
    T* out = dq + (int64_t(t) * nh + row0 + head) * kWgD + 2 * tq;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<uint32_t*>(out + 256 * wg + 8 * j) = pack2<T>(dqa[4 * j + 2 * x], dqa[4 * j + 2 * x + 1]);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<uint32_t*>(out + kWgC + 32 * wg + 8 * j) = pack2<T>(dqb[4 * j + 2 * x], dqb[4 * j + 2 * x + 1]);
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// ---- The indexer's scores at GLM-5's head width (128) on wgmma: a block 64 queries x 256 keys,
// warpgroup w the keys 128w..; the key tile stays in shared memory while the heads' query tiles
// stream through two buffers (cp.async, one head ahead); per head S = Q_h K^T (m64n128k16) and
// acc += w[i, h] relu(S), head h + 1's product running while head h's is folded in. One block a
// multiprocessor (218 registers).
constexpr int kIdxD = 128, kIdxRows = 64, kIdxKeys = 256;

size_t indexer_wgmma_smem(int n) {
  return size_t(kIdxKeys + 2 * kIdxRows) * kIdxD * 2 + size_t(kIdxRows) * (n + 1) * sizeof(float);
}

// Rows row0.. of a [rows, 128] matrix (row r at src + r * stride, rows past `valid` zero) into a
// core-matrix tile of Rows rows: threads 2i, 2i + 1 a row's 32-byte sector, 8 rows a group of 16.
template <int Rows, typename T>
__device__ __forceinline__ void load_rows_tile(unsigned char* dst, const T* src, int64_t stride, int valid) {
  constexpr int kChunks = kIdxD / 8;
  for (int i = threadIdx.x; i < Rows * kChunks; i += kWgThreads) {
    const int r = i / 128 * 8 + i / 2 % 8, c = i / 16 % 8 * 2 + i % 2;
    const bool ok = r < valid;
    cp_async16(dst + wgmma::tile_offset<Rows>(r, c * 8), ok ? src + r * stride + c * 8 : src, ok);
  }
}

template <typename T>
__global__ void __launch_bounds__(kWgThreads, 1)
    indexer_scores_wgmma_kernel(const T* __restrict__ q, int64_t q_stride, const T* __restrict__ k, int64_t k_stride,
                                const float* __restrict__ w, float* __restrict__ out, int B, int Nk, int n,
                                int64_t first, float scale) {
#if defined(V4_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* sK = smem;                              // [256 keys x 128]
  unsigned char* sQ = sK + kIdxKeys * kIdxD * 2;          // [2][64 x 128]
  float* sW = reinterpret_cast<float*>(sQ + 2 * kIdxRows * kIdxD * 2);  // [64][n + 1], times scale
  const int row0 = blockIdx.y * kIdxRows, col0 = blockIdx.x * kIdxKeys;
  const int rows_valid = min(kIdxRows, B - row0), cols_valid = min(kIdxKeys, Nk - col0);
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, r0 = 16 * warp + lane / 4,
            tq = lane % 4;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (col0 > first + row0 + rows_valid - 1) {  // every key of the tile is after every query
    for (int i = threadIdx.x; i < rows_valid * cols_valid; i += kWgThreads)
      out[(row0 + i / cols_valid) * int64_t(Nk) + col0 + i % cols_valid] = kNegInf;
    return;
  }
  for (int i = threadIdx.x; i < kIdxRows * n; i += kWgThreads)  // pitch n + 1: no bank conflict a head
    sW[i / n * (n + 1) + i % n] = i / n < rows_valid ? w[(row0 + i / n) * int64_t(n) + i % n] * scale : 0.0f;
  const T* q0 = q + row0 * q_stride;
  const uint32_t k_addr = wgmma::saddr(sK), q_addr = wgmma::saddr(sQ);
  const auto load_head = [&](int h) {
    load_rows_tile<kIdxRows>(sQ + h % 2 * kIdxRows * kIdxD * 2, q0 + h * kIdxD, q_stride, rows_valid);
    cp_async_commit();
  };
  const auto scores = [&](int h, float(&s)[64]) {  // s = Q_h K^T, issued (asynchronous)
#pragma unroll
    for (int j = 0; j < 64; ++j) s[j] = 0.0f;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kIdxD / 16; ++kk)  // the query tile's column groups 1,024 apart, the keys' 4,096
      wgmma::mma<T, 128>(s, wgmma::desc(q_addr + h % 2 * kIdxRows * kIdxD * 2 + kk * 2048, 1024, 128),
                         wgmma::desc(k_addr + wg * 2048 + kk * 8192, 4096, 128));
    wgmma::commit();
  };
  float acc[64] = {}, s0[64], s1[64];
  // Head h's product done (in cur), head h + 1's issued into `next` before cur is folded into acc,
  // so that the tensor cores run while the threads take relu and the head weights.
  const auto step = [&](int h, float(&cur)[64], float(&next)[64]) {
    wgmma::wait<0>();
    if (h + 1 < n) {
      cp_async_wait<0>();
      wgmma::fence_shared();
    }
    __syncthreads();  // head h + 1's queries are in; every warpgroup is done with head h's buffer
    if (h + 1 < n) {
      if (h + 2 < n) load_head(h + 2);
      scores(h + 1, next);
    }
    const float w0 = sW[r0 * (n + 1) + h], w1 = sW[(r0 + 8) * (n + 1) + h];
#pragma unroll
    for (int j = 0; j < 64; ++j) acc[j] += (j % 4 < 2 ? w0 : w1) * fmaxf(cur[j], 0.0f);
  };
  load_rows_tile<kIdxKeys>(sK, k + col0 * k_stride, k_stride, cols_valid);
  load_head(0);  // with the keys
  if (n > 1) {
    load_head(1);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  wgmma::fence_shared();
  __syncthreads();  // the keys and head 0's queries are in
  scores(0, s0);
  for (int h = 0; h < n; h += 2) {
    step(h, s0, s1);
    if (h + 1 < n) step(h + 1, s1, s0);
  }
  wgmma::wait<0>();  // nothing in flight (n >= 1); without it ptxas serialises every product
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int r = r0 + 8 * x;
    if (r >= rows_valid) continue;
    float* dst = out + (row0 + r) * int64_t(Nk) + col0;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = wg * 128 + 8 * j + 2 * tq + e;
        if (c < cols_valid) dst[c] = col0 + c > first + row0 + r ? kNegInf : acc[4 * j + 2 * x + e];
      }
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// dq[t] and the atomic dkv contributions of query t: with p = exp(scale s - lse), dp = dout . v,
// ds = p (dp - delta) scale: dq = ds . k; dkv[idx] += ds^T q + (p^T dout on the value columns).
// dout [Lq, nh, C] is read in place, with strides dout_stride = (query, head), as autograd gives
// it (sparse_latent_backward).
// Warp w: scores of rows 16 (w % 4).. and keys 16 (w / 4)..; dq columns (w / 4) dp / 2 ..;
// the dkv tile's keys 16 (w % 2).. and columns (w / 2) dp / 4 .., NQ = dp / 16 dq tiles per warp.
template <typename T, int NQ>
__global__ void __launch_bounds__(kSparseThreads, 1)
    sparse_backward_kernel(const T* __restrict__ q, const T* __restrict__ kv, const int64_t* __restrict__ idx,
                           const T* __restrict__ dout, longlong2 dout_stride, const float* __restrict__ lse,
                           const float* __restrict__ delta, T* __restrict__ dq, float* __restrict__ dkv, SparseShape s,
                           float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int pitch = s.pitch(), cpitch = s.cp + 8, t = blockIdx.x, row0 = blockIdx.y * kHeads,
            valid = min(kHeads, s.nh - row0);
  constexpr int kPP = kKeys + 8;  // pitch of the p and ds tiles
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + kHeads * pitch;                 // [kHeads][cpitch]
  T* sK = sdO + kHeads * cpitch;                // [2][kKeys][pitch]
  T* sP = sK + 2 * kKeys * pitch;               // [kHeads][kPP]
  T* sdS = sP + kHeads * kPP;                   // [kHeads][kPP]
  float* sStat = reinterpret_cast<float*>(sdS + kHeads * kPP);  // lse * log2e, delta: [2][kHeads]
  int* sKey = reinterpret_cast<int*>(sStat + 2 * kHeads);      // [3][kKeys]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const int wr = (warp % 4) * 16, kc = (warp / 4) * 16, qc = (warp / 4) * (s.dp / 2);
  const int vk = (warp % 2) * 16, vc = (warp / 2) * (s.dp / 4);
  const float sl2 = scale * kLog2e;

  load_rows_async(sQ, pitch, q + (int64_t(t) * s.nh + row0) * s.D, s.D, s.D, valid, s.dp);
  load_rows_async(sdO, cpitch, dout + t * dout_stride.x + row0 * dout_stride.y, dout_stride.y, s.C, valid, s.cp);
  for (int r = threadIdx.x; r < kHeads; r += kSparseThreads) {
    const int64_t row = int64_t(t) * s.nh + row0 + r;
    sStat[r] = r < valid ? lse[row] * kLog2e : std::numeric_limits<float>::infinity();  // p = 0 on padding rows
    sStat[kHeads + r] = r < valid ? delta[row] : 0.0f;
  }
  float dqa[NQ][4] = {};
  for_each_key_tile(sK, sKey, kv, idx, s, t, [&](const T* keys, const int* key_ids) {
    float sc[2][4], dp[2][4];
    scores16(sc, sQ + wr * pitch, pitch, keys + kc * pitch, pitch, s.dp, lane);
    scores16(dp, sdO + wr * cpitch, cpitch, keys + kc * pitch, pitch, s.cp, lane);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int key = kc + j * 8 + 2 * tq, row = wr + g + (e >= 2 ? 8 : 0);
        float pv[2], ds[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const bool ok = key_ids[key + x] >= 0;
          pv[x] = ok ? exp2f(sc[j][e + x] * sl2 - sStat[row]) : 0.0f;
          ds[x] = pv[x] * (dp[j][e + x] - sStat[kHeads + row]) * scale;
        }
        *reinterpret_cast<uint32_t*>(sP + row * kPP + key) = pack2<T>(pv[0], pv[1]);
        *reinterpret_cast<uint32_t*>(sdS + row * kPP + key) = pack2<T>(ds[0], ds[1]);
      }
    __syncthreads();
    // dq (rows wr.., columns qc..) += ds (rows wr.., 32 keys) . k (32 keys, columns qc..)
    uint32_t a[2][4];
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) ldsm_x4(a[ks], sdS + (wr + lane % 16) * kPP + ks * 16 + (lane / 16) * 8);
    accumulate_pv<T, NQ>(dqa, a, keys, pitch, qc, s.dp / 2, lane);
    // dkv tile (keys vk.., columns vc.. in chunks of 8 tiles) = ds^T q + p^T dout
    for (int c0 = vc; c0 < vc + s.dp / 4; c0 += 64) {
      float kva[8][4] = {};
#pragma unroll
      for (int hs = 0; hs < kHeads / 16; ++hs) {
        uint32_t dst[4], pt[4];
        // A = ds^T / p^T: keys x heads, from the [heads, keys] tiles read transposed
        const int mi = lane / 8;
        ldsm_x4_t(dst, sdS + (hs * 16 + (mi / 2) * 8 + lane % 8) * kPP + vk + (mi % 2) * 8);
        ldsm_x4_t(pt, sP + (hs * 16 + (mi / 2) * 8 + lane % 8) * kPP + vk + (mi % 2) * 8);
        const int head = hs * 16 + lane % 8 + ((lane / 8) % 2) * 8, end = vc + s.dp / 4;
#pragma unroll
        for (int j = 0; j < 8; j += 2) {  // two column tiles per load where both exist
          const int col = c0 + j * 8;
          if (col >= end) break;
          if (col + 8 < end) {
            uint32_t bq[4];
            ldsm_x4_t(bq, sQ + head * pitch + col + (lane / 16) * 8);
            mma16816<T>(kva[j], dst, {bq[0], bq[1]});
            mma16816<T>(kva[j + 1], dst, {bq[2], bq[3]});
            if (col + 16 <= s.cp) {  // both tiles are value columns
              uint32_t bo[4];
              ldsm_x4_t(bo, sdO + head * cpitch + col + (lane / 16) * 8);
              mma16816<T>(kva[j], pt, {bo[0], bo[1]});
              mma16816<T>(kva[j + 1], pt, {bo[2], bo[3]});
            } else if (col < s.cp) {  // the first only (col is a multiple of 8, not 16, of cp)
              uint32_t bo[2];
              ldsm_x2_t(bo, sdO + head * cpitch + col);
              mma16816<T>(kva[j], pt, bo);
            }
          } else {
            uint32_t bq[2];
            ldsm_x2_t(bq, sQ + head * pitch + col);
            mma16816<T>(kva[j], dst, bq);
            if (col < s.cp) {
              uint32_t bo[2];
              ldsm_x2_t(bo, sdO + head * cpitch + col);
              mma16816<T>(kva[j], pt, bo);
            }
          }
        }
      }
      // 16-byte atomics: lanes 2i and 2i + 1 swap halves, so that the even one holds 4 columns of
      // row g and the odd one 4 columns of row g + 8.
      const bool odd = tq & 1;
      const int row = vk + g + (odd ? 8 : 0), key = key_ids[row];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (c0 + j * 8 >= min(vc + s.dp / 4, s.D)) break;
        const float r0 = __shfl_xor_sync(0xffffffff, odd ? kva[j][0] : kva[j][2], 1);
        const float r1 = __shfl_xor_sync(0xffffffff, odd ? kva[j][1] : kva[j][3], 1);
        const float4 v = odd ? make_float4(r0, r1, kva[j][2], kva[j][3]) : make_float4(kva[j][0], kva[j][1], r0, r1);
        if (key >= 0) atomicAdd(reinterpret_cast<float4*>(dkv + int64_t(key) * s.D + c0 + j * 8 + 4 * (tq / 2)), v);
      }
    }
  });
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int row = wr + g + 8 * x;
    if (row >= valid) continue;
    T* out = dq + (int64_t(t) * s.nh + row0 + row) * s.D;
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
      const int col = qc + j * 8 + 2 * tq;
      if (j * 8 < s.dp / 2 && col < s.D) *reinterpret_cast<uint32_t*>(out + col) = pack2<T>(dqa[j][2 * x], dqa[j][2 * x + 1]);
    }
  }
}

SparseShape sparse_shape(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, int64_t C) {
  const int D = q.size(2);
  return SparseShape{int(q.size(0)), int(q.size(1)), D, int(C), int(idx.size(1)), (D + 31) / 32 * 32,
                     int((C + 31) / 32 * 32)};
}

size_t forward_smem(const SparseShape& s, size_t elem) {
  return (size_t(kHeads) + 2 * kKeys) * s.pitch() * elem + kHeads * (kKeys + 4) * sizeof(float) + 3 * kKeys * sizeof(int);
}

size_t backward_smem(const SparseShape& s, size_t elem) {
  return (size_t(kHeads) * s.pitch() + size_t(kHeads) * (s.cp + 8) + 2 * kKeys * s.pitch() + 2 * kHeads * (kKeys + 8)) * elem +
         2 * kHeads * sizeof(float) + 3 * kKeys * sizeof(int);
}

// The wgmma sparse kernels: GLM-5's widths.
bool wgmma_applies(const at::Tensor& q, const SparseShape& s, size_t smem) {
  return s.D == kWgD && s.C == kWgC && wgmma::capable(q.get_device(), smem);
}

// The template instance for n tiles of 8 columns per warp (the fewest that hold them).
template <typename F>
void with_tiles(int n, F&& f) {
  if (n <= 4) f(std::integral_constant<int, 4>{});
  else if (n <= 16) f(std::integral_constant<int, 16>{});
  else if (n <= 32) f(std::integral_constant<int, 32>{});
  else if (n <= 36) f(std::integral_constant<int, 36>{});
  else TORCH_CHECK(false, "sparse latent attention kernel: ", n, " column tiles per warp is more than 36");
}

template <typename F>
void with_type(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) f(__nv_bfloat16{});
  else f(__half{});
}

}  // namespace

bool sparse_latent_supported(const at::Tensor& q, const at::Tensor& kv, int64_t C) {
  if (!q.is_cuda() || (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)) return false;
  if (kv.device() != q.device() || kv.scalar_type() != q.scalar_type()) return false;
  int major = 0;  // built for sm_90 (float4 atomics, the shared memory sizes)
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  const int64_t D = q.size(2);
  if (major < 9 || D % 8 != 0 || C % 8 != 0 || C > D || (D + 31) / 32 > 36 || kv.size(1) != D) return false;
  const SparseShape s{0, 0, int(D), int(C), 0, int((D + 31) / 32 * 32), int((C + 31) / 32 * 32)};
  return backward_smem(s, q.element_size()) <= size_t(wgmma::max_smem(q.get_device()));
}

std::tuple<at::Tensor, at::Tensor> sparse_latent_forward(const at::Tensor& q_in, const at::Tensor& kv_in,
                                                         const at::Tensor& idx_in, double scale, int64_t C) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  TORCH_CHECK(idx_in.dim() == 2 && idx_in.size(0) == q_in.size(0) && idx_in.scalar_type() == at::kLong,
              "sparse_latent_forward: idx must be int64 [", q_in.size(0), ", K], got ", idx_in.sizes());
  const at::Tensor q = dense16(q_in), kv = dense16(kv_in), idx = idx_in.contiguous();
  const SparseShape s = sparse_shape(q, kv, idx, C);
  if (s.K == 0) {  // no key: nothing attended, as the ATen path gives
    return {at::zeros({s.Lq, s.nh, C}, q.options()),
            at::full({s.Lq, s.nh}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat))};
  }
  at::Tensor o = at::empty({s.Lq, s.nh, C}, q.options());
  at::Tensor lse = at::empty({s.Lq, s.nh}, q.options().dtype(at::kFloat));
  if (s.Lq == 0 || s.nh == 0) return {o, lse};
  const dim3 grid(s.Lq, (s.nh + kHeads - 1) / kHeads);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (wgmma_applies(q, s, wgmma_forward_smem())) {
    with_type(q, [&](auto type) {
      using T = decltype(type);
      wgmma::launch(sparse_forward_wgmma_kernel<T>, grid, kFwdThreads, wgmma_forward_smem(), stream,
                    reinterpret_cast<const T*>(q.const_data_ptr()), reinterpret_cast<const T*>(kv.const_data_ptr()),
                    idx.const_data_ptr<int64_t>(), reinterpret_cast<T*>(o.mutable_data_ptr()),
                    lse.mutable_data_ptr<float>(), s.nh, s.K, float(scale));
    });
    return {o, lse};
  }
  const size_t smem = forward_smem(s, q.element_size());
  with_type(q, [&](auto type) {
    using T = decltype(type);
    with_tiles(s.cp / 16, [&](auto nt) {
      wgmma::launch(sparse_forward_kernel<T, decltype(nt)::value>, grid, kSparseThreads, smem, stream,
                    reinterpret_cast<const T*>(q.const_data_ptr()), reinterpret_cast<const T*>(kv.const_data_ptr()),
                    idx.const_data_ptr<int64_t>(), reinterpret_cast<T*>(o.mutable_data_ptr()),
                    lse.mutable_data_ptr<float>(), s, float(scale));
    });
  });
  return {o, lse};
}

// delta[r] = dout[t, h, :C] . o[t, h, :C] in float32 for row r = t nh + h (the backward's softmax
// term): a warp a row, 16-byte loads of both; dout strided by (query, head) as the backward reads
// it, o contiguous. One read of each, where ATen's float32 chain wrote and read four copies.
template <typename T>
__global__ void sparse_delta_kernel(const T* __restrict__ dout, longlong2 dout_stride, const T* __restrict__ o,
                                    float* __restrict__ delta, int nh, int C, int64_t rows) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (r >= rows) return;  // a whole warp: r is the same in its lanes
  const int lane = threadIdx.x % 32;
  const T* a = dout + r / nh * dout_stride.x + r % nh * dout_stride.y;
  const T* b = o + r * C;
  float sum = 0.0f;
  for (int c = 8 * lane; c < C; c += 256) {
    const uint4 x = *reinterpret_cast<const uint4*>(a + c), y = *reinterpret_cast<const uint4*>(b + c);
    const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 u = unpack2<T>(xs[k]), v = unpack2<T>(ys[k]);
      sum += u.x * v.x + u.y * v.y;
    }
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) delta[r] = sum;
}

std::tuple<at::Tensor, at::Tensor> sparse_latent_backward(const at::Tensor& q_in, const at::Tensor& kv_in,
                                                          const at::Tensor& idx_in, const at::Tensor& o,
                                                          const at::Tensor& lse, const at::Tensor& dout_in,
                                                          double scale, int64_t C) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = dense16(q_in), kv = dense16(kv_in), idx = idx_in.contiguous();
  // latent_attention's last product gives dout transposed ([nh, Lq, C] in memory): read in place
  // where cp.async can (16-byte aligned rows), not copied (a [Lq, nh, C] tensor: 8 GiB of GLM-5's
  // 131,072-token step).
  const at::Tensor dout_typed = dout_in.to(q.scalar_type());
  const bool in_place = dout_typed.stride(2) == 1 && dout_typed.stride(0) % 8 == 0 && dout_typed.stride(1) % 8 == 0 &&
                        aligned16(dout_typed.const_data_ptr());
  const at::Tensor dout = in_place ? dout_typed : dense16(dout_typed), lse_c = lse.contiguous();
  const SparseShape s = sparse_shape(q, kv, idx, C);
  at::Tensor dkv = at::zeros({kv.size(0), s.D}, kv.options().dtype(at::kFloat));
  if (s.Lq == 0 || s.nh == 0 || s.K == 0) return {at::zeros_like(q), dkv};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // delta = rowsum(dout * o) [Lq, nh] in float32 (rows 16-byte aligned: C % 8 == 0, dout as above)
  at::Tensor delta = at::empty({s.Lq, s.nh}, q.options().dtype(at::kFloat));
  TORCH_CHECK(o.scalar_type() == q.scalar_type() && o.sizes() == dout.sizes(), "sparse_latent_backward: o must be ",
              "the forward's [Lq, nh, C] output in q's dtype, got ", o.sizes(), " ", o.scalar_type());
  TORCH_CHECK(C % 8 == 0, "sparse_latent_backward: C (the value columns) must be a multiple of 8 for the device ",
              "kernels' 16-byte rows, got ", C, " (sparse_latent_supported says which inputs these kernels take)");
  const at::Tensor oc = dense16(o);
  const int64_t rows = int64_t(s.Lq) * s.nh;
  with_type(q, [&](auto type) {
    using T = decltype(type);
    wgmma::launch(sparse_delta_kernel<T>, dim3((rows + 7) / 8), 256, 0, stream,
                  reinterpret_cast<const T*>(dout.const_data_ptr()), longlong2{dout.stride(0), dout.stride(1)},
                  reinterpret_cast<const T*>(oc.const_data_ptr()), delta.mutable_data_ptr<float>(), s.nh, int(C), rows);
  });
  at::Tensor dq = at::empty_like(q);
  const dim3 grid(s.Lq, (s.nh + kHeads - 1) / kHeads);
  if (wgmma_applies(q, s, wgmma_backward_smem())) {
    with_type(q, [&](auto type) {
      using T = decltype(type);
      wgmma::launch(sparse_backward_wgmma_kernel<T>, grid, kWgThreads, wgmma_backward_smem(), stream,
                    reinterpret_cast<const T*>(q.const_data_ptr()), reinterpret_cast<const T*>(kv.const_data_ptr()),
                    idx.const_data_ptr<int64_t>(), reinterpret_cast<const T*>(dout.const_data_ptr()),
                    longlong2{dout.stride(0), dout.stride(1)}, lse_c.const_data_ptr<float>(),
                    delta.const_data_ptr<float>(), reinterpret_cast<T*>(dq.mutable_data_ptr()),
                    dkv.mutable_data_ptr<float>(), s.nh, s.K, float(scale));
    });
    return {dq, dkv};
  }
  const size_t smem = backward_smem(s, q.element_size());
  with_type(q, [&](auto type) {
    using T = decltype(type);
    with_tiles(s.dp / 16, [&](auto nq) {
      wgmma::launch(sparse_backward_kernel<T, decltype(nq)::value>, grid, kSparseThreads, smem, stream,
                    reinterpret_cast<const T*>(q.const_data_ptr()), reinterpret_cast<const T*>(kv.const_data_ptr()),
                    idx.const_data_ptr<int64_t>(), reinterpret_cast<const T*>(dout.const_data_ptr()),
                    longlong2{dout.stride(0), dout.stride(1)}, lse_c.const_data_ptr<float>(),
                    delta.const_data_ptr<float>(), reinterpret_cast<T*>(dq.mutable_data_ptr()),
                    dkv.mutable_data_ptr<float>(), s, float(scale));
    });
  });
  return {dq, dkv};
}

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, int64_t first,
                          double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && w.dim() == 2 && q.size(2) == k.size(1) && w.size(0) == q.size(0) &&
                  w.size(1) == q.size(1) && w.scalar_type() == at::kFloat && q.scalar_type() == k.scalar_type(),
              "indexer_scores: q [B, n, d], k [Nk, d], w [B, n] float32 expected, got ", q.sizes(), " ", k.sizes(),
              " ", w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == 1, "indexer_scores: rows of q and k ",
              "must be contiguous");
  const c10::cuda::CUDAGuard guard(q.device());
  const int B = q.size(0), n = q.size(1), d = q.size(2), Nk = k.size(0);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty({B, Nk}, q.options().dtype(at::kFloat));
  if (B == 0 || Nk == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = d % 8 == 0 && q.stride(0) % 8 == 0 && k.stride(0) % 8 == 0 && aligned16(q.const_data_ptr()) &&
                   aligned16(k.const_data_ptr());
  if ((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) && d == kIdxD && vec &&
      n > 0 && wgmma::capable(q.get_device(), indexer_wgmma_smem(n))) {
    with_type(q, [&](auto type) {
      using T = decltype(type);
      wgmma::launch(indexer_scores_wgmma_kernel<T>, dim3((Nk + kIdxKeys - 1) / kIdxKeys, (B + kIdxRows - 1) / kIdxRows),
                    kWgThreads, indexer_wgmma_smem(n), stream, reinterpret_cast<const T*>(q.const_data_ptr()),
                    q.stride(0), reinterpret_cast<const T*>(k.const_data_ptr()), k.stride(0),
                    wc.const_data_ptr<float>(), out.mutable_data_ptr<float>(), B, Nk, n, first, float(scale));
    });
    return out;
  }
  const int dp = (d + 15) / 16 * 16;
  const size_t smem = size_t(kCols + kRows) * (dp + kPad) * q.element_size() + size_t(kRows) * n * sizeof(float);
  const dim3 grid((Nk + kCols - 1) / kCols, (B + kRows - 1) / kRows);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "indexer_scores: bfloat16 or float16 expected, got ", q.scalar_type());
  with_type(q, [&](auto type) {
    using T = decltype(type);
    wgmma::launch(indexer_scores_kernel<T>, grid, kThreads, smem, stream,
                  reinterpret_cast<const T*>(q.const_data_ptr()), q.stride(0),
                  reinterpret_cast<const T*>(k.const_data_ptr()), k.stride(0), wc.const_data_ptr<float>(),
                  out.mutable_data_ptr<float>(), B, Nk, n, d, first, float(scale), vec);
  });
  return out;
}

namespace {

bool indexer_scores_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, int64_t first, double scale,
                           at::Tensor& out) {
  if (!q.is_cuda() || (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)) return false;
  out = indexer_scores(q, k, w, first, scale);
  return true;
}

bool sparse_forward_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, double scale, int64_t C,
                           at::Tensor& o, at::Tensor& lse) {
  if (!sparse_latent_supported(q, kv, C)) return false;
  std::tie(o, lse) = sparse_latent_forward(q, kv, idx, scale, C);
  return true;
}

bool sparse_backward_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const at::Tensor& o,
                            const at::Tensor& lse, const at::Tensor& dout, double scale, int64_t C, at::Tensor& dq,
                            at::Tensor& dkv) {
  if (!sparse_latent_supported(q, kv, C)) return false;
  std::tie(dq, dkv) = sparse_latent_backward(q, kv, idx, o, lse, dout, scale, C);
  return true;
}

const Backend<dsa::IndexerScores>::Register indexer_registered(c10::DeviceType::CUDA, &indexer_scores_kernel);
const Backend<dsa::SparseForward>::Register forward_registered(c10::DeviceType::CUDA, &sparse_forward_kernel);
const Backend<dsa::SparseBackward>::Register backward_registered(c10::DeviceType::CUDA, &sparse_backward_kernel);

}  // namespace
}  // namespace v4::cuda
