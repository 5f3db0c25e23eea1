// CUDA kernels of v4_gated_delta_rule: the fused path (gdr::Fused in gated_delta_rule.h). Built by
// tools/build_ext.py where nvcc and a CUDA torch exist; registered for CUDA tensors with
// v4::Backend, so the op's ATen code needs no #ifdef.
//
// The math, per chunk of 64 and value head (gated_delta_rule.h; the reference's `chunked`):
// G the cumulative log decay (float64), E = exp(G), L_ij = exp(G_i - G_j) (j <= i), Q and K the
// normalised queries and keys, A = strictly lower (diag(beta) K K^T * L), R = [beta V | beta E K],
// X = [U | W] = (I + A)^-1 R; across chunks from S = 0: h = S, v_new = U - W S,
// S = exp(G_63) S + Kt^T v_new with Kt = exp(G_63 - G) K; o = E (Q h) + ((Q K^T) * L) v_new.
// Forward: prepare (U, W, Kt per chunk), recurrence (h, v_new per document), output (o per chunk).
// Backward: local_grads (v_new's and h's gradients from o's), the recurrence in reverse (the
// state's gradient after each chunk and v_new's whole gradient), state_grads (the products with h
// and the state's gradient), intra_grads (q's gradient; k's and G's parts from inside the chunk),
// wy_grads (the UT transform's backward: k's, v's, beta's and g's gradients). A kernel takes one
// chunk and head per block; its products are shared-memory tiles through block_gemm, on TF32 tensor
// cores for bfloat16 inputs, on the FP32 units for float32 (Mode below); at Qwen3.5's widths in
// bfloat16 the kernels take their operands through ldmatrix (kPlanes): as bf16 hi / lo planes (three
// products for one of float32's precision) where a product needs it, rounded once to bfloat16 (one
// product) where it does not (the recurrence's, state_grads', and q S in output and local_grads; on
// planes the reverse recurrence forms local_grads' h gradient itself, from E Q rounded); intra_grads
// and state_grads run as one kernel on planes (dqkwg_planes) that reads q, k and d_o as their raw
// bfloat16 rows; so do prepare's and wy_grads' K K^T and the output's and local_grads' Q K^T (one
// exact product, the norms applied after it), and prepare's [U | W] (Ai's columns scaled, two
// products). On planes the states h and v_new are stored in bfloat16 (the products read them so:
// v_new exact in P v_new and d_o v_new^T; tools/delta_rule_split_check.py prices it against the
// judge). Products by a triangular matrix (Ai, P, dPL) skip its stored
// zeros, and those whose result is kept on one side of the diagonal skip the other side (Tri).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cc/common/backend.h"
#include "cc/common/cuda_types.cuh"
#include "cc/common/mma_sync.cuh"
#include "cc/ops/gated_delta_rule.h"

namespace v4::gdr {
namespace {

// 16 warps a block: the kernels that hold [64, 128] float32 tiles fit one block an SM, and at 8
// warps they waited on latency (ncu of the recurrence on the H200, 2026-12-03: 12.5% occupancy,
// 5 cycles per issued instruction, DRAM at 13.5%).
constexpr int kThreads = 512, kWarps = kThreads / 32, kRows = static_cast<int>(kChunk);
// The most value heads a key head may serve on the plane kernels, which sum them in a cluster of that
// many blocks (the portable cluster size): wider groups take the kernels off planes.
constexpr int kMaxCluster = 8;
constexpr int kRowThreads = kThreads / kRows;  // threads a row of a [64, 64] matrix (antisymmetric_row_sum)
// But prepare, whose forward substitution takes a thread a column of [U | W] (256): at 512 threads
// half of them idled there, one block a multiprocessor (0.486 ms a pass against 0.357 at 256, where
// two blocks shared one). On planes it keeps 256, two blocks a multiprocessor, its inverse a thread
// 16 rows of a column. The helpers it calls take the block size (Threads).
constexpr int kPrepareThreads = 256;
constexpr int kPitch64 = kRows + 4;  // a [64, 64] matrix's row pitch
static_assert(kRows == 64, "the kernels hold one chunk of 64 slots a block");

__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }
__host__ __device__ constexpr int larger(int a, int b) { return a > b ? a : b; }

// ---- Products on tensor cores --------------------------------------------------------------------

// How a kernel multiplies: on the FP32 units (float32 inputs: as the ATen path rounds), or on TF32
// tensor cores with each operand split into two TF32 parts, x = hi + lo + O(2^-20 |x|): hi lo + lo hi
// + hi hi is about float32's precision (bfloat16 inputs); the cross terms accumulate apart from
// hi hi, a second chain of tensor-core instructions. Both parts are truncated (the tensor core reads
// a TF32 operand's top 19 bits): rounding lo (cvt.rna) took five instructions a split on sm_90, one
// FSETP for every 0.75 HMMA in ncu's count (2026-12-02, stop 30). Plain TF32 (operands rounded to 10 bits)
// measured no faster on the H200 (2026-12-02: 3.25 / 9.87 ms against 3.21 / 9.96 at 8,192 tokens).
// Every operand rounded to bfloat16 (fla's precision, one m16n8k16 instruction for six) took 1.76 /
// 6.37 ms against 2.20 / 7.34 at 8,192 with the widths fixed, and failed a bf16 parity sample of
// v4_gated_deltanet (2026-12-02, stop 29; docs/benchmarks.md): only the products that the CPU judge
// allows are rounded so (kPlanes below).
enum class Mode { kFp32, kTf32x3 };

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;  // truncated: x - hi is exact
  lo = __float_as_uint(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Element (r, c) of a float32 matrix in shared memory, stored row-major (p[r * ld + c]) or, kT, as
// its transpose (p[c * ld + r]). Bank-conflict free: ld = 4 mod 8 for a row-major A or a
// transposed B, ld = 8 mod 16 for a transposed A or a row-major B.
template <bool kT>
__device__ __forceinline__ float at(const float* p, int ld, int r, int c) {
  return kT ? p[c * ld + r] : p[r * ld + c];
}

// Zero triangles of a chunk's [64, 64] matrices that a product skips (flags, or-ed; Tri::kNone: none).
// Ai = (I + A)^-1 is unit lower triangular, P = (Q K^T) * L and dPL lower with their diagonals, each
// with its other triangle stored as exact zeros, so a product has the same values without the terms
// they make (where the other operand is finite):
//   kLowerA: A's (r, k) is zero for r < k < 64 (A = P, dPL): a row tile's k loop skips from its rows'
//     end to 64;
//   kUpperA: A's (r, k) is zero for k < r < 64 (A = Ai^T, P^T, dPL^T): a row tile's starts at its rows;
//   kUpperB: B's (k, n) is zero for k > n (B = Ai^T): a column group's stops after its columns;
//   kLowerC: the epilogue keeps C's lower triangle alone (it writes a constant above the diagonal): a
//     tile wholly above it hands the epilogue zeros and multiplies nothing.
// With any of them the warps take their tiles back and forth (in odd rounds counted from the round's
// end), so that a triangle's long and short row tiles pair up; with kLowerC alone a row tile's column
// groups are rotated by its row, so that each of the four schedulers (warp % 4) has a share of the
// tiles below the diagonal (16 warps of one tile each: 3, 2, 3, 2 of a 4 x 4's 10, not 4, 3, 2, 1;
// dM's kUpperB | kLowerC is balanced without it).
namespace Tri {
enum : int { kNone = 0, kLowerA = 1, kUpperA = 2, kUpperB = 4, kLowerC = 8 };
}

// The row tile and column group of a tile (Tri).
template <int kTri>
__device__ __forceinline__ int2 tile_at(int tile, int ngroups) {
  const int row = tile / ngroups, col = tile % ngroups;
  return {row, kTri == Tri::kLowerC ? (col + ngroups - row % ngroups) % ngroups : col};
}

// Whether the product of a tile (rows from m0, columns n0 to n1) skips its k-step [k0, k1).
template <int kTri>
__device__ __forceinline__ bool skip_step(int m0, int n0, int n1, int k0, int k1) {
  return ((kTri & Tri::kLowerA) && k0 >= m0 + 16 && k1 <= kRows) || ((kTri & Tri::kUpperA) && k1 <= m0 && m0 < kRows) ||
         ((kTri & Tri::kUpperB) && k0 >= n1) || ((kTri & Tri::kLowerC) && n0 >= m0 + 16);
}

// A warp's tile after `tile` (the block's warps take `warps` tiles a round): in turn, or back and
// forth (in odd rounds counted from the round's end).
template <int kTri>
__device__ __forceinline__ int next_tile(int tile, int warp, int warps) {
  if constexpr (kTri == Tri::kNone) return tile + warps;
  return tile / warps % 2 == 0 ? tile + 2 * (warps - warp) - 1 : tile + 2 * warp + 1;
}

// C = A B over the block (of Threads), A [M, K] and B [K, N] in shared memory: each warp takes tiles of
// 16 x 8 NT of C (in turn, or as kTri deals them) and hands every element of C to epi(row, col,
// value), once. Reads A's rows up to round16(M) and both operands' K up to a multiple of 8, B's
// columns up to a multiple of 8: callers keep those paddings zero. kTri: the zero triangles it skips
// (Tri).
template <int NT, bool kTA, bool kTB, Mode kMode, int kTri = Tri::kNone, int Threads = kThreads, typename Epi>
__device__ __forceinline__ void block_gemm(const float* A, int lda, const float* B, int ldb, int M, int N, int K,
                                           Epi&& epi) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int mtiles = (M + 15) / 16, ngroups = (N + 8 * NT - 1) / (8 * NT);
  for (int tile = warp; tile < mtiles * ngroups; tile = next_tile<kTri>(tile, warp, Threads / 32)) {
    const int2 place = tile_at<kTri>(tile, ngroups);
    const int m0 = place.x * 16, n0 = place.y * 8 * NT;
    float acc[NT][4] = {}, small[NT][4] = {};  // small: the cross terms (Mode)
    if constexpr (kMode == Mode::kTf32x3) {
      // Unrolled where K is a constant (FixedDims): the fragments' shared-memory offsets fold into
      // the loads (the op 2.5% faster at 8,192 tokens on the H200, 2026-12-02, stop 31).
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 8) {
        if (skip_step<kTri>(m0, n0, n0 + 8 * NT, k0, k0 + 8)) continue;
        uint32_t ah[4], al[4];
        split(at<kTA>(A, lda, m0 + g, k0 + t), ah[0], al[0]);
        split(at<kTA>(A, lda, m0 + g + 8, k0 + t), ah[1], al[1]);
        split(at<kTA>(A, lda, m0 + g, k0 + t + 4), ah[2], al[2]);
        split(at<kTA>(A, lda, m0 + g + 8, k0 + t + 4), ah[3], al[3]);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (n0 + 8 * j < N) {
            uint32_t bh[2], bl[2];
            split(at<kTB>(B, ldb, k0 + t, n0 + 8 * j + g), bh[0], bl[0]);
            split(at<kTB>(B, ldb, k0 + t + 4, n0 + 8 * j + g), bh[1], bl[1]);
            mma_tf32(small[j], al, bh);
            mma_tf32(small[j], ah, bl);
            mma_tf32(acc[j], ah, bh);
          }
        }
      }
    } else {
      for (int k = 0; k < K; ++k) {
        if (skip_step<kTri>(m0, n0, n0 + 8 * NT, k, k + 1)) continue;
        const float a0 = at<kTA>(A, lda, m0 + g, k), a1 = at<kTA>(A, lda, m0 + g + 8, k);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (n0 + 8 * j < N) {
            const float b0 = at<kTB>(B, ldb, k, n0 + 8 * j + 2 * t), b1 = at<kTB>(B, ldb, k, n0 + 8 * j + 2 * t + 1);
            acc[j][0] = fmaf(a0, b0, acc[j][0]);
            acc[j][1] = fmaf(a0, b1, acc[j][1]);
            acc[j][2] = fmaf(a1, b0, acc[j][2]);
            acc[j][3] = fmaf(a1, b1, acc[j][3]);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + g + e / 2 * 8, c = n0 + 8 * j + 2 * t + e % 2;
        if (r < M && c < N) epi(r, c, kMode == Mode::kTf32x3 ? acc[j][e] + small[j][e] : acc[j][e]);
      }
    }
  }
}

// ---- Shared memory ---------------------------------------------------------------------------------

// Cuts a kernel's dynamic shared memory into arrays, in the same order on the host (base null: the
// size) and in the kernel.
struct Carve {
  unsigned char* base;
  size_t used = 0;
  template <typename X>
  __host__ __device__ X* take(size_t n) {
    used = (used + 15) / 16 * 16;
    X* p = reinterpret_cast<X*>(base + used);
    used += n * sizeof(X);
    return p;
  }
};

// One chunk of one value head: its slots' tokens and the decays.
struct Info {
  int64_t slot[kRows];  // the token of each slot; T for padding
  double G[kRows];      // the cumulative log decay, float64
  float beta[kRows], E[kRows], Kt[kRows];  // exp(G), exp(G_63 - G) (as the reference: exp in float64)
  float gamma;          // exp(G_63), the chunk's decay of the state
};

// What every kernel reads: the inputs, the sizes, and the chunk-layout tensors ([chunks, Hv, 64 or
// Dk, Dv or Dk], float32; h and d_state bfloat16 for the plane kernels) that pass between the kernels.
struct Args {
  const void *q, *k, *v, *d_o;
  const double* g;
  const float* beta;
  const int64_t* slots;
  int64_t T;
  int hk, hv, dk, dv;
  float scale;  // Dk^-0.5
  void* u;                                   // prepare: U (float32; bfloat16 for kPlanes)
  float *w, *k_tilde, *gamma;
  float *ai, *kkl;                           // and in the backward, Ai and L * K K^T for wy_grads
  const void* h;                             // the forward's states (float32; bfloat16 for kPlanes)
  const void* v_new;                         // and corrected values (float32; bfloat16 for kPlanes)
  void* o;                                   // output
  void* dv_local;                            // local_grads (float32; bfloat16 for kPlanes)
  float* dh_local;
  __nv_bfloat16* eq;                         // or (kPlanes) E Q rounded, for the reverse recurrence
  const void* d_state;                       // the reverse recurrence's (as h)
  const void* dv_new;                        // the reverse recurrence's (float32; bfloat16 for kPlanes)
  float *dq_state, *dw, *dk_tilde, *dgamma;  // state_grads (dw on planes: bfloat16, in each chunk's first half)
  float *dq, *dk_part;                       // intra_grads (dq per value head, token layout)
  double* dg_part;
  float *dk_out, *dbeta;                     // wy_grads (dk per value head, token layout)
  __nv_bfloat16 *dq_keys, *dk_keys;          // or (kPlanes) dq and dk [T, key heads, 128], summed in clusters
  void* dv_out;
  double* dg;
};

struct Dims {
  int dk, dv, pk, pv;  // widths and widths padded to 16
  __host__ __device__ Dims(int dk_, int dv_) : dk(dk_), dv(dv_), pk(round16(dk_)), pv(round16(dv_)) {}
};
// Qwen3.5's widths as constants, so every pitch, loop bound and index division folds: with the
// widths read at run time those were most of the kernels' instructions (ncu on the H200,
// 2026-12-02: 33,000 a block per chunk step of the recurrence, for 96 tensor-core instructions).
template <int kDk, int kDv>
struct FixedDims {
  static constexpr int dk = kDk, dv = kDv, pk = round16(kDk), pv = round16(kDv);
};
// bfloat16 inputs at Qwen3.5's widths: the plane kernels (ldmatrix fragments, bf16 products). Their
// operands are split into two bfloat16 planes (hi = bf16(x), lo = bf16(x - hi)) where a product must
// keep float32's precision (three bf16 products for block_gemm's six TF32 ones), and rounded once to
// bfloat16 where one product will do (fla's precision): the sites W S, q S and K~^T v_new, forward
// and backward (the recurrence's two products, state_grads' three, the output's E Q h, local_grads'
// (E Q)^T d_o; prepare writes W and K~ as bfloat16, [64, D] in the bytes of a [64, D] float32 tile).
// Which products may be rounded once was judged on the CPU by the parity suite's judge:
// tools/delta_rule_split_check.py.
template <Mode kMode, typename DimsT>
constexpr bool kPlanes = kMode == Mode::kTf32x3 && !std::is_same_v<DimsT, Dims>;

template <typename DimsT>
__host__ __device__ DimsT dims_of(int dk, int dv) {
  if constexpr (std::is_same_v<DimsT, Dims>) return Dims(dk, dv);
  else return DimsT{};
}

// In place, 64 float64 values in shared memory, by warp 0: inclusive sums from the first (or, with
// `reverse`, from the last). The caller synchronises after.
__device__ __forceinline__ void scan64(double* v, bool reverse) {
  if (threadIdx.x >= 32) return;
  const int l = threadIdx.x, i0 = reverse ? 63 - 2 * l : 2 * l, i1 = reverse ? 62 - 2 * l : 2 * l + 1;
  const double a = v[i0];
  double run = a + v[i1];
  for (int o = 1; o < 32; o *= 2) {
    const double n = __shfl_up_sync(0xffffffffu, run, o);
    if (l >= o) run += n;
  }
  double before = __shfl_up_sync(0xffffffffu, run, 1);
  if (l == 0) before = 0.0;
  v[i0] = before + a;
  v[i1] = run;
}

__device__ void load_info(Info& s, const Args& p, int64_t chunk, int h) {
  const int i = threadIdx.x;
  if (i < kRows) {
    const int64_t tok = p.slots[chunk * kRows + i];
    s.slot[i] = tok;
    s.beta[i] = tok < p.T ? p.beta[tok * p.hv + h] : 0.0f;
    s.G[i] = tok < p.T ? p.g[tok * p.hv + h] : 0.0;
  }
  __syncthreads();
  scan64(s.G, false);
  __syncthreads();
  if (i < kRows) {
    s.E[i] = static_cast<float>(exp(s.G[i]));
    s.Kt[i] = static_cast<float>(exp(s.G[kRows - 1] - s.G[i]));
    if (i == 0) s.gamma = static_cast<float>(exp(s.G[kRows - 1]));
  }
  __syncthreads();
}

// The start of every per-chunk kernel: its shared arrays (Smem), the chunk and value head it takes
// (its rows of the [chunks, Hv, 64, D] tensors from `rows`; its key head), and the chunk's Info.
// early(m, head), where given, issues the block's asynchronous copies that need no Info (complete at
// wait_copies()) before load_info, so that their bytes are in flight during its dependent loads and
// scan: a block's start waiting on load_info was 12% of the stall samples of state_grads on planes
// (ncu 2026-12-06).
struct NoEarly {
  template <typename Smem>
  __device__ void operator()(const Smem&, int64_t) const {}
};
template <typename Smem, typename DimsT>
struct ChunkBlock {
  DimsT d;
  Carve carve;
  Smem m;
  Info& s;
  int64_t chunk, head, rows;
  int h, kh;
  template <typename Early = NoEarly>
  __device__ ChunkBlock(const Args& p, unsigned char* smem, Early early = {})
      : d(dims_of<DimsT>(p.dk, p.dv)), carve{smem}, m(carve, d), s(*m.info), chunk(blockIdx.x),
        head(chunk * p.hv + blockIdx.y), rows(head * kRows), h(blockIdx.y), kh(h / (p.hv / p.hk)) {
    early(m, head);
    load_info(s, p, chunk, h);
  }
};

__device__ __forceinline__ float decay(const Info& s, int i, int j) { return expf(static_cast<float>(s.G[i] - s.G[j])); }

// Loads from global memory are issued many at a time before any is used (a thread that loads, stores
// and loads again waits a memory latency per element: that was most of the first version's time).

// 16 bytes global -> shared without passing through registers (cp.async): complete after wait_copies().
__device__ __forceinline__ void copy16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::); }
// wait_copies() but for those issued since the last commit_copies(), which may still be in flight.
__device__ __forceinline__ void wait_copies_before() { asm volatile("cp.async.commit_group;\ncp.async.wait_group 1;\n" ::); }
// copy16, or 16 zero bytes where !valid (cp.async's zero fill; src not read).
__device__ __forceinline__ void copy16_fill(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__host__ __device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// dst [prows, pcols] (pitch ld) = src [rows, cols] (float32, row stride `stride`), zero outside it:
// asynchronous 16-byte copies where the rows allow (then wait_copies() and a barrier before reading),
// else plain loads, four in flight a thread.
__device__ __forceinline__ void load_block(float* dst, int ld, const float* src, int64_t stride, int rows, int cols,
                                           int prows, int pcols) {
  if (cols % 4 == 0 && stride % 4 == 0 && pcols % 4 == 0 && ld % 4 == 0 && aligned16(src) && aligned16(dst)) {
    const int quads = pcols / 4;
    for (int idx = threadIdx.x; idx < prows * quads; idx += kThreads) {
      const int r = idx / quads, c = idx % quads * 4;
      if (r < rows && c < cols) copy16(dst + r * ld + c, src + r * stride + c);
      else *reinterpret_cast<float4*>(dst + r * ld + c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    return;
  }
  const int n = prows * pcols;
  for (int i0 = threadIdx.x; i0 < n; i0 += 4 * kThreads) {
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i0 + u * kThreads, r = idx / pcols, c = idx % pcols;
      v[u] = idx < n && r < rows && c < cols ? src[r * stride + c] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i0 + u * kThreads;
      if (idx < n) dst[idx / pcols * ld + idx % pcols] = v[u];
    }
  }
}

// dst [rows, cols] (row stride `stride`) = src [rows, cols] in shared memory (pitch ld): four floats a
// store where the widths and addresses allow (the recurrence's state and x tiles, each chunk step).
__device__ __forceinline__ void store_block(float* dst, int64_t stride, const float* src, int ld, int rows, int cols) {
  if (cols % 4 == 0 && stride % 4 == 0 && ld % 4 == 0 && aligned16(dst) && aligned16(src)) {
    const int quads = cols / 4;
    for (int idx = threadIdx.x; idx < rows * quads; idx += kThreads) {
      const int r = idx / quads, c = idx % quads * 4;
      *reinterpret_cast<float4*>(dst + r * stride + c) = *reinterpret_cast<const float4*>(src + r * ld + c);
    }
    return;
  }
  for (int idx = threadIdx.x; idx < rows * cols; idx += kThreads) {
    const int r = idx / cols, c = idx % cols;
    dst[r * stride + c] = src[r * ld + c];
  }
}

// The chunk's rows of x [T, heads, D] (head `head`) as float32: dst[i][c] = x[slot i][c] (times mul[i]
// if given), zero for padding slots and columns D..padded (a multiple of 16). 16-byte loads, four in
// flight a thread, where D and x allow.
template <typename T, int Threads = kThreads>
__device__ __forceinline__ void load_rows(float* dst, int ld, const T* x, int heads, int head, int D, int padded,
                                          const float* mul, const Info& s, int64_t T_) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = D % V == 0 && aligned16(x);
  const int per_row = vec ? padded / V : padded, n = kRows * per_row, width = vec ? V : 1;
  for (int i0 = threadIdx.x; i0 < n; i0 += 4 * Threads) {
    uint4 raw[4];
    T one[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i0 + u * Threads, i = idx / per_row, c = idx % per_row * width;
      const int64_t tok = idx < n ? s.slot[i] : T_;
      const bool in = tok < T_ && c < D;
      const T* src = x + (tok * heads + head) * D + c;
      if (vec) raw[u] = in ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
      else one[u] = in ? *src : from_float<T>(0.0f);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i0 + u * Threads, i = idx / per_row, c = idx % per_row * width;
      if (idx >= n) continue;
      const float m = mul != nullptr ? mul[i] : 1.0f;
      if (vec) {
        const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (int j = 0; j < V; ++j) dst[i * ld + c + j] = to_float(e[j]) * m;
      } else {
        dst[i * ld + c] = to_float(one[u]) * m;
      }
    }
  }
}

// rsqrt(|row|^2 + 1e-6) of a warp's row, its columns lane + 32 m in v: the sums in one order wherever
// a row's norm is taken, so that load_normalised, normalise_rows and row_rnorms give the same values.
__device__ __forceinline__ float row_rnorm(const float (&v)[4]) {
  float ss = 0.0f;
#pragma unroll
  for (int m = 0; m < 4; ++m) ss += v[m] * v[m];
  return rsqrtf(warp_sum(ss) + 1e-6f);
}

// The chunk's rows of x [T, heads, D] L2-normalised, a warp 64 / (Threads / 32) rows (loads issued together):
// dst[i][c] = x r scale with r = rsqrt(|x|^2 + 1e-6) into rnorm[i] (if given); zero for padding slots
// and columns D..padded (D <= 128).
//
// normalise_rows does the second half for values already in registers: v[j][m] is row warp + j
// (Threads / 32)'s column lane + 32 m; each stored value times mul(i) (after the product with scale:
// the roundings of a pass that multiplies the stored rows; times 1 is exact); r goes to norm(i, r)
// (callbacks, so that nothing is tested at run time: a null test cost two kernels a spill).
template <int Threads, int R, typename Mul, typename Norm>
__device__ __forceinline__ void normalise_rows(const float (&v)[R][4], float* dst, int ld, int padded, float scale,
                                               Mul&& mul, Norm&& norm) {
  constexpr int kW = Threads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int i = warp + j * kW;
    const float r = row_rnorm(v[j]), e = mul(i);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int c = lane + 32 * m;
      if (c < padded) dst[i * ld + c] = v[j][m] * r * scale * e;
    }
    if (lane == 0) norm(i, r);
  }
}
template <typename T, int Threads = kThreads>
__device__ __forceinline__ void load_normalised(float* dst, int ld, float* rnorm, const T* x, int heads, int head,
                                                int D, int padded, float scale, const Info& s, int64_t T_) {
  constexpr int kW = Threads / 32, R = kRows / kW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float v[R][4];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int64_t tok = s.slot[warp + j * kW];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int c = lane + 32 * m;
      v[j][m] = tok < T_ && c < D ? to_float(x[(tok * heads + head) * D + c]) : 0.0f;
    }
  }
  normalise_rows<Threads>(v, dst, ld, padded, scale, [](int) { return 1.0f; }, [&](int i, float r) {
    if (rnorm != nullptr) rnorm[i] = r;
  });
}

// The backward of load_normalised for one row (a warp): with y the normalised row (row(c) gives
// y_c * scale, as load_normalised stores it) and r its rsqrt, out = r (dy - y (y . dy)), dy = scale * grad.
// In two halves, so that a caller may sum several rows' dots over the warp at once (warp_sums):
// normalised_terms, this lane's y, dy and its share of the dot; normalised_write, out from them.
template <typename Row>
__device__ __forceinline__ float normalised_terms(float (&y)[4], float (&dy)[4], Row&& row, const float* grad, int D,
                                                  float scale) {
  const int lane = threadIdx.x % 32;
  float dot = 0.0f;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int c = lane + 32 * m;
    y[m] = c < D ? row(c) / scale : 0.0f;
    dy[m] = c < D ? scale * grad[c] : 0.0f;
    dot += y[m] * dy[m];
  }
  return dot;
}
__device__ __forceinline__ void normalised_write(float* out, float r, const float (&y)[4], const float (&dy)[4],
                                                 float dot, int D) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int c = lane + 32 * m;
    if (c < D) out[c] = r * (dy[m] - y[m] * dot);
  }
}
template <typename Row>
__device__ __forceinline__ void normalised_backward(float* out, Row&& row, float r, const float* grad, int D,
                                                    float scale) {
  float y[4], dy[4];
  const float dot = warp_sum(normalised_terms(y, dy, row, grad, D, scale));
  normalised_write(out, r, y, dy, dot, D);
}

// x = (I + A)^-1 x for a strictly lower triangular A [64, ld] in shared memory (forward
// substitution; the rows read four at a time).
__device__ __forceinline__ void forward_substitution(float (&x)[kRows], const float* A, int ld) {
#pragma unroll
  for (int i = 1; i < kRows; ++i) {
    float acc[4] = {x[i], 0.0f, 0.0f, 0.0f};  // four chains: a row's sum is not one long dependency
#pragma unroll
    for (int j = 0; j + 4 <= i; j += 4) {
      const float4 a = *reinterpret_cast<const float4*>(A + i * ld + j);
      acc[0] = fmaf(-a.x, x[j], acc[0]);
      acc[1] = fmaf(-a.y, x[j + 1], acc[1]);
      acc[2] = fmaf(-a.z, x[j + 2], acc[2]);
      acc[3] = fmaf(-a.w, x[j + 3], acc[3]);
    }
#pragma unroll
    for (int j = i / 4 * 4; j < i; ++j) acc[j % 4] = fmaf(-A[i * ld + j], x[j], acc[j % 4]);
    x[i] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  }
}

// G's gradient through L from Z [64, kLd] in shared memory: sum_j Z_ij - Z_ji in float64 for row
// i = threadIdx.x / kRowThreads, kRowThreads threads a row (64 / kRowThreads j each, then shuffles),
// in every thread of the row. Every thread calls it. (One thread a row, 64 dependent float64
// additions, took 8% of wy_grads.) At kLd = 68 a warp's column reads Z_ji (its rows j 8 apart, the
// same bank) are 8-way bank conflicted; at 65 two-way, its row reads one float a load.
template <int kLd = kPitch64>
__device__ __forceinline__ double antisymmetric_row_sum(const float* Z) {
  static_assert(kRowThreads >= 1 && kRowThreads <= 32 && kRows % kRowThreads == 0, "a row's threads in one warp");
  constexpr int kSpan = kRows / kRowThreads;
  const int i = threadIdx.x / kRowThreads, j0 = threadIdx.x % kRowThreads * kSpan;
  double acc = 0.0;
#pragma unroll
  for (int j = j0; j < j0 + kSpan; ++j) acc += static_cast<double>(Z[i * kLd + j]) - Z[j * kLd + i];
#pragma unroll
  for (int o = 1; o < kRowThreads; o *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

// The block's sum of one float a thread (every thread calls it).
__device__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// ---- Products from planes (kPlanes) ---------------------------------------------------------------

// A key head's gradient (q's or k's) from its value heads' shares, each the float32 rows [64, ld] in
// shared memory of one block of the cluster (the hv / hk value heads of one chunk, ranks in value-head
// order), summed rank 0 first as sum_value_heads_kernel adds them (the same bits) and written once in
// bfloat16 to out [T, hk, 128]. The shares went through global memory in float32 before: 2 x 537 MB
// written and read again at 32K tokens, and a launch of their own (0.45 ms). Rank j sums rows j, j +
// ranks, ..., reading the other blocks' shared memory (distributed shared memory); the second barrier
// keeps every block's rows until the others have read them.
__device__ __forceinline__ void sum_over_value_heads(const float* rows, int ld, __nv_bfloat16* out, const Info& s,
                                                     const Args& p, int kh) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  constexpr int kQuads = 128 / 4, kPass = kThreads / kQuads;  // a row's quads (128 wide: kPlanes); rows a pass
  const int c = threadIdx.x % kQuads * 4;
  cluster.sync();  // every block's rows are in
  for (int i = rank + threadIdx.x / kQuads * ranks; i < kRows; i += kPass * ranks) {
    const int64_t tok = s.slot[i];
    if (tok >= p.T) continue;
    float4 acc = *reinterpret_cast<const float4*>(cluster.map_shared_rank(rows, 0) + i * ld + c);
    for (int j = 1; j < ranks; ++j) {
      const float4 x = *reinterpret_cast<const float4*>(cluster.map_shared_rank(rows, j) + i * ld + c);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    *reinterpret_cast<uint2*>(out + (tok * p.hk + kh) * 128 + c) =
        make_uint2(pack2<__nv_bfloat16>(acc.x, acc.y), pack2<__nv_bfloat16>(acc.z, acc.w));
  }
  cluster.sync();  // no block leaves (its shared memory) while another reads it
}

// hi and lo of (x0, x1) at p and p + lo_offset (bfloat16 elements), a pair of columns each.
__device__ __forceinline__ void store_split2(__nv_bfloat16* p, int lo_offset, float x0, float x1) {
  const uint32_t hi = pack2<__nv_bfloat16>(x0, x1);
  const float2 h = unpack2<__nv_bfloat16>(hi);
  *reinterpret_cast<uint32_t*>(p) = hi;
  *reinterpret_cast<uint32_t*>(p + lo_offset) = pack2<__nv_bfloat16>(x0 - h.x, x1 - h.y);
}

// hi and lo of four columns at p and p + lo_offset (bfloat16 elements, 8-byte aligned) as one 8-byte
// store each (two 4-byte stores each were 2-way bank conflicted: a warp's two rows 144 bytes apart).
__device__ __forceinline__ void store_split4(__nv_bfloat16* p, int lo_offset, float4 x) {
  const uint32_t h01 = pack2<__nv_bfloat16>(x.x, x.y), h23 = pack2<__nv_bfloat16>(x.z, x.w);
  const float2 f01 = unpack2<__nv_bfloat16>(h01), f23 = unpack2<__nv_bfloat16>(h23);
  *reinterpret_cast<uint2*>(p) = make_uint2(h01, h23);
  *reinterpret_cast<uint2*>(p + lo_offset) =
      make_uint2(pack2<__nv_bfloat16>(x.x - f01.x, x.y - f01.y), pack2<__nv_bfloat16>(x.z - f23.x, x.w - f23.y));
}

// hi and lo of x at p and p + lo_offset (bfloat16 elements).
__device__ __forceinline__ void store_split1(__nv_bfloat16* p, int lo_offset, float x) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(x);
  p[0] = hi;
  p[lo_offset] = __float2bfloat16_rn(x - __bfloat162float(hi));
}

// acc += A B and cross += the split's cross terms, for a 16 x 8 tile: A's fragments (hi, lo) and B's.
__device__ __forceinline__ void mma_bf16x3(float (&acc)[4], float (&cross)[4], const uint32_t (&ah)[4],
                                           const uint32_t (&al)[4], const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
  mma16816<__nv_bfloat16>(cross, ah, bl);
  mma16816<__nv_bfloat16>(cross, al, bh);
  mma16816<__nv_bfloat16>(acc, ah, bh);
}

constexpr int kPlaneRow = 128 + 8;  // a planes row of 128: 16-byte aligned, 16 bytes apart in the banks
constexpr int kPlane64 = kRows + 8;  // a planes row of 64: 16-byte aligned, 16 bytes apart in the banks

constexpr int kNever = 1 << 30;  // plane_gemm's kOnceFrom, kOnceFromRow: no product rounded once

// One 8-byte store (a float2's was split into two 4-byte ones in the PTX: half the stores' sectors).
__device__ __forceinline__ void store2(float* at, float x0, float x1) {
  *reinterpret_cast<unsigned long long*>(at) =
      static_cast<unsigned long long>(__float_as_uint(x1)) << 32 | __float_as_uint(x0);
}

// C = A B over the block from planes in shared memory (hi at X, lo at X + x_lo), A [M, K] stored
// [K, M] (kTA) or [M, K] (pitch lda), B [K, N] stored [N, K] (kTB) or [K, N] (pitch ldb): each warp
// takes 16 x 8 NT tiles of C (as block_gemm deals them; NT even) and hands every element of C to
// epi(row, col, value) once, or each pair of columns (col even) to epi(row, col, value, value at
// col + 1): an epilogue that writes global memory takes pairs, 8 bytes a lane, so that a warp's
// store fills its 32-byte sectors (one element a lane wrote half of each: ncu of state_grads,
// 2026-12-06, L2 at 93%). M, N, K are multiples of 16 within the planes. kBExact: B is bfloat16
// values (its lo plane zero, not read), two products for three; kAExact likewise for A; both, one
// product. From k = kOnceFrom on, and in C's rows from kOnceFromRow on (multiples of 16), both
// operands are taken rounded to bfloat16 (their hi planes): one product. kTri: the zero triangles
// it skips (Tri). Threads: the block's size.
template <int NT, bool kTA, bool kTB, bool kBExact = false, bool kAExact = false, int kOnceFrom = kNever,
          int kOnceFromRow = kNever, int kTri = Tri::kNone, int Threads = kThreads, typename Epi>
__device__ __forceinline__ void plane_gemm(const __nv_bfloat16* A, int lda, int a_lo, const __nv_bfloat16* B, int ldb,
                                           int b_lo, int M, int N, int K, Epi&& epi) {
  static_assert(NT % 2 == 0, "B's fragments two n-tiles at a time");
  static_assert(kOnceFrom % 16 == 0 && kOnceFromRow % 16 == 0, "once from whole k-steps and row tiles");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ngroups = N / (8 * NT);
  for (int tile = warp; tile < M / 16 * ngroups; tile = next_tile<kTri>(tile, warp, Threads / 32)) {
    const int2 place = tile_at<kTri>(tile, ngroups);
    const int m0 = place.x * 16, n0 = place.y * 8 * NT;
    float acc[NT][4] = {}, cross[NT][4] = {};
    const auto k_step = [&](int k0, bool once) {
      if (skip_step<kTri>(m0, n0, n0 + 8 * NT, k0, k0 + 16)) return;
      uint32_t ah[4], al[4] = {};
      if constexpr (kTA) {
        const int a_at = (k0 + lane % 8 + lane / 16 * 8) * lda + m0 + lane / 8 % 2 * 8;
        ldsm_x4_t(ah, A + a_at);
        if (!kAExact && !once) ldsm_x4_t(al, A + a_lo + a_at);
      } else {
        const int a_at = (m0 + lane % 16) * lda + k0 + lane / 16 * 8;
        ldsm_x4(ah, A + a_at);
        if (!kAExact && !once) ldsm_x4(al, A + a_lo + a_at);
      }
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t bh[4], bl[4] = {};
        if constexpr (kTB) {
          const int b_at = (n0 + 8 * j + lane / 16 * 8 + lane % 8) * ldb + k0 + lane / 8 % 2 * 8;
          ldsm_x4(bh, B + b_at);
          if (!kBExact && !once) ldsm_x4(bl, B + b_lo + b_at);
        } else {
          const int b_at = (k0 + lane % 16) * ldb + n0 + 8 * j + lane / 16 * 8;
          ldsm_x4_t(bh, B + b_at);
          if (!kBExact && !once) ldsm_x4_t(bl, B + b_lo + b_at);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // n-tiles j and j + 1
          const uint32_t bhh[2] = {bh[2 * half], bh[2 * half + 1]}, blh[2] = {bl[2 * half], bl[2 * half + 1]};
          if ((kAExact && kBExact) || once) {
            mma16816<__nv_bfloat16>(acc[j + half], ah, bhh);
          } else if constexpr (kAExact) {
            mma16816<__nv_bfloat16>(cross[j + half], ah, blh);
            mma16816<__nv_bfloat16>(acc[j + half], ah, bhh);
          } else if constexpr (kBExact) {
            mma16816<__nv_bfloat16>(cross[j + half], al, bhh);
            mma16816<__nv_bfloat16>(acc[j + half], ah, bhh);
          } else {
            mma_bf16x3(acc[j + half], cross[j + half], ah, al, bhh, blh);
          }
        }
      }
    };
    if constexpr (kOnceFrom == kNever && kOnceFromRow == kNever) {
#pragma unroll 4
      for (int k0 = 0; k0 < K; k0 += 16) k_step(k0, false);
    } else {  // two loops: with `once` decided in one, both kinds of step were issued under predicates
      const int split = m0 >= kOnceFromRow ? 0 : min(K, kOnceFrom);
#pragma unroll 4
      for (int k0 = 0; k0 < split; k0 += 16) k_step(k0, false);
#pragma unroll 4
      for (int k0 = split; k0 < K; k0 += 16) k_step(k0, true);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if constexpr (std::is_invocable_v<Epi&, int, int, float, float>) {  // columns c and c + 1 a call
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          epi(m0 + g + e / 2 * 8, n0 + 8 * j + 2 * t, acc[j][e] + cross[j][e], acc[j][e + 1] + cross[j][e + 1]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) epi(m0 + g + e / 2 * 8, n0 + 8 * j + 2 * t + e % 2, acc[j][e] + cross[j][e]);
      }
    }
  }
}

// Planes [rows, kWidth] (pitch ld, lo at + lo_off) of float32 src (row stride `stride`, rows
// 16-byte aligned) into dst, four floats a thread at a time, four loads in flight. lo_off < 0: the
// values rounded to bfloat16, the hi plane alone (four values a store: ld a multiple of 4).
template <int kWidth = 128>
__device__ __forceinline__ void load_split(__nv_bfloat16* dst, const float* src, int rows, int lo_off,
                                           int ld = kPlaneRow, int64_t stride = kWidth) {
  constexpr int kQuads = kWidth / 4, kStep = kThreads / kQuads;  // kStep: rows a pass of the block
  static_assert(kThreads % kQuads == 0, "a thread's column the same in every pass");
  const int r0 = threadIdx.x / kQuads, c = threadIdx.x % kQuads * 4;
  // The passes counted from 0, not from threadIdx.x: the bounds fold where rows is a constant
  for (int p0 = 0; p0 < rows; p0 += 4 * kStep) {
    float4 a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = p0 + u * kStep + r0;
      if (p0 + (u + 1) * kStep <= rows || r < rows) a[u] = *reinterpret_cast<const float4*>(src + r * stride + c);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = p0 + u * kStep + r0;
      if (!(p0 + (u + 1) * kStep <= rows || r < rows)) continue;
      __nv_bfloat16* at = dst + r * ld + c;
      if (lo_off < 0) {
        *reinterpret_cast<uint2*>(at) =
            make_uint2(pack2<__nv_bfloat16>(a[u].x, a[u].y), pack2<__nv_bfloat16>(a[u].z, a[u].w));
      } else {
        store_split4(at, lo_off, a[u]);
      }
    }
  }
}

// The chunk's rows of x [T, heads, 128] (bfloat16) as planes (pitch kPlaneRow, lo at + lo_off): hi
// the values, lo zero (bfloat16 is exact in hi); zero rows for padding slots. lo_off < 0: the hi
// plane alone (for plane_gemm's kAExact / kBExact, which do not read lo).
template <int Threads = kThreads>
__device__ __forceinline__ void load_rows_split(__nv_bfloat16* dst, int lo_off, const __nv_bfloat16* x, int heads,
                                                int head, const Info& s, int64_t T_) {
  constexpr int kPieces = 128 / 8;  // 16 bytes each
  // The alignment decided once, outside the loop: decided in it, the eight loads of the unaligned
  // case were issued under a predicate beside every copy (ncu's SASS, 2026-12-06).
  static_assert(Threads % kPieces == 0 && kRows % (Threads / kPieces) == 0, "whole rows a pass");
  const int i0 = threadIdx.x / kPieces, c = threadIdx.x % kPieces * 8;
  const auto rows = [&](auto piece) {
#pragma unroll 1
    for (int u = 0; u < kRows * kPieces / Threads; ++u) {
      const int i = i0 + u * (Threads / kPieces);
      const int64_t tok = s.slot[i];
      __nv_bfloat16* at = dst + i * kPlaneRow + c;
      if (tok >= T_) *reinterpret_cast<uint4*>(at) = make_uint4(0, 0, 0, 0);
      else piece(at, x + (tok * heads + head) * 128 + c);
      if (lo_off >= 0) *reinterpret_cast<uint4*>(at + lo_off) = make_uint4(0, 0, 0, 0);
    }
  };
  if (aligned16(x)) rows([](__nv_bfloat16* at, const __nv_bfloat16* src) { copy16(at, src); });
  else rows([](__nv_bfloat16* at, const __nv_bfloat16* src) { for (int j = 0; j < 8; ++j) at[j] = src[j]; });
}

// load_rows_split's hi plane alone (lo_off < 0) of the rows of N inputs at once (wy_grads' k and v, the
// output's q and k, local_grads' q, k and d_o), with the chunk's slots read from `slots` (its 64 in
// global memory, once for all), not from Info: ChunkBlock's early copies, issued before load_info.
struct EarlyRows {
  __nv_bfloat16* dst;
  const __nv_bfloat16* x;
  int heads, head;
};
template <bool kFill = false, int Threads = kThreads, typename... Rows>
__device__ __forceinline__ void load_rows_early(const int64_t* slots, int64_t T_, Rows... in) {
  constexpr int kPieces = 128 / 8, kPasses = kRows * kPieces / Threads;  // 16 bytes each
  static_assert(Threads % kPieces == 0 && kRows % (Threads / kPieces) == 0, "whole rows a pass");
  const int i0 = threadIdx.x / kPieces, c = threadIdx.x % kPieces * 8;
  int64_t tok[kPasses];
#pragma unroll
  for (int u = 0; u < kPasses; ++u) tok[u] = slots[i0 + u * (Threads / kPieces)];
  // kFill: padding rows zero without a branch by token (cp.async's zero fill; plain: a select), from
  // token 0's row: under one, local_grads' smem base left the uniform registers and its product
  // spilled (64 registers). Else a padding row's 16 bytes are stored as zeros.
  const auto rows = [&](const EarlyRows& r, auto piece) {
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      __nv_bfloat16* at = r.dst + (i0 + u * (Threads / kPieces)) * kPlaneRow + c;
      const auto row = [&](int64_t t) { return r.x + (t * r.heads + r.head) * 128 + c; };
      if constexpr (kFill) {
        const bool in_doc = tok[u] < T_;
        piece(at, row(in_doc ? tok[u] : 0), in_doc);
      } else if (tok[u] >= T_) {
        *reinterpret_cast<uint4*>(at) = make_uint4(0, 0, 0, 0);
      } else {
        piece(at, row(tok[u]), true);
      }
    }
  };
  const auto copy = [](__nv_bfloat16* at, const __nv_bfloat16* src, bool valid) {
    if constexpr (kFill) copy16_fill(at, src, valid);
    else copy16(at, src);
  };
  const auto plain = [](__nv_bfloat16* at, const __nv_bfloat16* src, bool valid) {
    for (int j = 0; j < 8; ++j) at[j] = valid ? src[j] : __nv_bfloat16();
  };
  const auto one = [&](const EarlyRows& r) {
    if (aligned16(r.x)) rows(r, copy);
    else rows(r, plain);
  };
  (one(in), ...);
}

// rows x kWidth values (bfloat16 or float32) at src (row stride `stride`) into dst (pitch ld), 16
// bytes a copy (cp.async: complete after wait_copies()); rows 16-byte aligned at both ends (the plane
// kernels' own tensors and shared tiles).
template <int kWidth, typename E>
__device__ __forceinline__ void copy_rows(E* dst, int ld, const E* src, int64_t stride, int rows) {
  constexpr int kPer = 16 / sizeof(E), kPieces = kWidth / kPer, kStep = kThreads / kPieces;  // kStep: rows a pass
  static_assert(kThreads % kPieces == 0, "a thread's column the same in every pass");
  const int r0 = threadIdx.x / kPieces, c = threadIdx.x % kPieces * kPer;
  dst += r0 * ld + c;  // the thread's first piece: the passes' offsets are constants where ld, stride are
  src += r0 * stride + c;
#pragma unroll 4
  for (int p0 = 0; p0 < rows; p0 += kStep) {
    if (p0 + kStep <= rows || p0 + r0 < rows) copy16(dst + p0 * ld, src + p0 * stride);
  }
}

// A warp's rows of 128 bfloat16 values at x (pitch ld, in shared memory) in registers, as
// normalise_rows and row_rnorm take them: v[j][m] = row warp + j (Threads / 32)'s column lane + 32 m.
template <int Threads, int R>
__device__ __forceinline__ void rows_of(float (&v)[R][4], const __nv_bfloat16* x, int ld) {
  constexpr int kW = Threads / 32;
  static_assert(kRows == R * kW, "a warp R whole rows");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int m = 0; m < 4; ++m) v[j][m] = __bfloat162float(x[(warp + j * kW) * ld + lane + 32 * m]);
}

// rnorm[i] = rsqrt(|x_i|^2 + 1e-6) of the 64 rows of 128 bfloat16 values at x (pitch ld), a warp a
// row (row_rnorm, so load_normalised's values). A warp's rows are summed side by side (one row's
// shuffles after another's were 18% of prepare_planes' stall samples, ncu 2026-12-06).
template <int Threads = kThreads>
__device__ __forceinline__ void row_rnorms(float* rnorm, const __nv_bfloat16* x, int ld) {
  constexpr int kW = Threads / 32, R = kRows / kW;
  float v[R][4];
  rows_of<Threads>(v, x, ld);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const float r = row_rnorm(v[j]);
    if (lane == 0) rnorm[warp + j * kW] = r;
  }
}

// QP [64, ldqp] float32 (columns 0..191) as planes in its own storage (hi [64, ldqp], then lo):
// every value read before any is written.
__device__ __forceinline__ void split_in_place(float* QP, int ldqp) {
  constexpr int kPairs = kRows * (kRows + 128) / 2 / kThreads;
  float2 v[kPairs];
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int idx = threadIdx.x + u * kThreads, r = idx / ((kRows + 128) / 2), c = idx % ((kRows + 128) / 2) * 2;
    v[u] = *reinterpret_cast<const float2*>(QP + r * ldqp + c);
  }
  __syncthreads();
  auto* planes = reinterpret_cast<__nv_bfloat16*>(QP);
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int idx = threadIdx.x + u * kThreads, r = idx / ((kRows + 128) / 2), c = idx % ((kRows + 128) / 2) * 2;
    store_split2(planes + r * ldqp + c, kRows * ldqp, v[u].x, v[u].y);
  }
}

// ---- Forward ---------------------------------------------------------------------------------------

struct PrepareSmem {
  Info* info;
  float *R, *A;  // R [64, pv + pk + 4]: values then keys; A [64, 68]
  int ldr;
  template <typename DimsT>
  __host__ __device__ PrepareSmem(Carve& c, const DimsT& d) : ldr(d.pv + d.pk + 4) {
    info = c.take<Info>(1);
    R = c.take<float>(kRows * ldr);
    A = c.take<float>(kRows * kPitch64);
  }
};

// U, W (= (I + A)^-1 [beta V | beta E K]), Kt = exp(G_63 - G) K and gamma for one chunk and head
// (U not when p.u is null: the backward's recomputation, which writes Ai and L * K K^T for wy_grads).
template <typename T, Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kPrepareThreads) prepare_kernel(Args p) {
  static_assert(!kPlanes<kMode, DimsT>, "on planes, prepare_planes_kernel");
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkBlock<PrepareSmem, DimsT> b(p, smem);
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t chunk = b.chunk, base = b.rows;
  const int h = b.h, kh = b.kh, tid = threadIdx.x;
  float* K = m.R + d.pv;  // the keys' columns of R
  load_normalised<T, kPrepareThreads>(K, m.ldr, nullptr, static_cast<const T*>(p.k), p.hk, kh, d.dk, d.pk, 1.0f, s,
                                      p.T);
  __syncthreads();
  for (int idx = tid; idx < kRows * d.dk; idx += kPrepareThreads) {
    const int i = idx / d.dk, c = idx % d.dk;
    p.k_tilde[(base + i) * d.dk + c] = s.Kt[i] * K[i * m.ldr + c];
  }
  if (tid == 0) p.gamma[chunk * p.hv + h] = s.gamma;
  block_gemm<2, false, true, kMode, Tri::kLowerC, kPrepareThreads>(
      K, m.ldr, K, m.ldr, kRows, kRows, d.dk,
      [&](int r, int c, float v) {
        const float kkl = c < r ? v * decay(s, r, c) : 0.0f;
        m.A[r * kPitch64 + c] = s.beta[r] * kkl;
        if (p.kkl != nullptr) p.kkl[(base + r) * kRows + c] = kkl;
      });
  __syncthreads();
  load_rows<T, kPrepareThreads>(m.R, m.ldr, static_cast<const T*>(p.v), p.hv, h, d.dv, d.pv, s.beta, s, p.T);
  for (int idx = tid; idx < kRows * d.pk; idx += kPrepareThreads) {
    const int i = idx / d.pk, c = idx % d.pk;
    K[i * m.ldr + c] *= s.beta[i] * s.E[i];
  }
  __syncthreads();
  // The backward's recomputation: Ai = (I + A)^-1 for wy_grads, a column a thread by the same forward
  // substitution (threads that the value columns leave idle there, where dv >= 64).
  if (p.ai != nullptr && tid < kRows) {
    float e[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) e[i] = i == tid ? 1.0f : 0.0f;
    forward_substitution(e, m.A, kPitch64);
#pragma unroll
    for (int i = 0; i < kRows; ++i) p.ai[(base + i) * kRows + tid] = e[i];
  }
  // One column of X a thread: forward substitution in registers, written out row by row.
  const bool value = tid < d.dv;
  if (tid >= d.dv + d.dk || (value && p.u == nullptr)) return;
  const int col = value ? tid : d.pv + tid - d.dv;
  float x[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) x[i] = m.R[i * m.ldr + col];
  forward_substitution(x, m.A, kPitch64);
  float* out = value ? static_cast<float*>(p.u) + base * d.dv + tid : p.w + base * d.dk + (tid - d.dv);
  const int stride = value ? d.dv : d.dk;
#pragma unroll
  for (int i = 0; i < kRows; ++i) out[i * stride] = x[i];
}

// prepare_kernel on planes (kPlanes): the forward substitution, a thread a column of [U | W], was half
// its instructions (ncu on the H100, 2026-12-06). Here the block forms Ai = (I + A)^-1 by blocks of
// 16 rows (below), and X = Ai R runs on tensor cores from the raw bfloat16 rows with R's row scales folded into Ai's columns:
// U = (Ai diag(beta)) v and W = (Ai diag(beta E r_k)) k, M = Ai diag(.) as planes and v, k exact, two
// products for three (wy_grads' own fold). K K^T is one exact product of k's raw rows, the norms
// applied after it (as build_qp_planes' Q K^T). M's planes take A's and Ai's bytes, dead once the
// inverse is in registers: 73.7 KB a block, three a multiprocessor (kBlocks 3; ncu of the H100,
// thirty-fourth session, at two: 40% of the issue slots busy, 0.64 warps of 4 eligible a scheduler).
struct PreparePlanesSmem {
  Info* info;
  float *rk, *A, *Ai;              // r_k [64]; A [64, 68]; Ai [64, 68]: the inverse's rows handed over
  __nv_bfloat16 *k, *v, *mu, *mw;  // k's and v's raw rows [64, kPlaneRow]; M's planes [2][64, kPlane64], U's and
                                   // W's, over A and Ai
  template <typename DimsT>
  __host__ __device__ PreparePlanesSmem(Carve& c, const DimsT&) {
    info = c.take<Info>(1);
    rk = c.take<float>(kRows);
    k = c.take<__nv_bfloat16>(kRows * kPlaneRow);
    v = c.take<__nv_bfloat16>(kRows * kPlaneRow);
    unsigned char* inverse = c.take<unsigned char>(larger(2 * kRows * kPitch64 * sizeof(float),
                                                          2 * 2 * kRows * kPlane64 * sizeof(__nv_bfloat16)));
    A = reinterpret_cast<float*>(inverse);
    Ai = A + kRows * kPitch64;
    mu = reinterpret_cast<__nv_bfloat16*>(inverse);
    mw = mu + 2 * kRows * kPlane64;
  }
};

// x = (I + A_bb)^-1 x for the 16 rows i0.. of a thread's column c (forward substitution over the
// diagonal block of the strictly lower A [64, kPitch64] at i0), then x into Ai's rows i0.. of column c.
__device__ __forceinline__ void diagonal_solve(float (&x)[16], const float* A, float* Ai, int i0, int c) {
#pragma unroll
  for (int r = 1; r < 16; ++r) {
    const float* a = A + (i0 + r) * kPitch64 + i0;
#pragma unroll
    for (int j = 0; j < r; ++j) x[r] = fmaf(-a[j], x[j], x[r]);
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) Ai[(i0 + r) * kPitch64 + c] = x[r];
}

// kBlocks: blocks a multiprocessor (3: 80 registers, a few bytes spilled; 2: 104, none).
template <typename DimsT, int kBlocks>
__global__ void __launch_bounds__(kPrepareThreads, kBlocks) prepare_planes_kernel(Args p) {
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  constexpr int kT = kPrepareThreads, kLo64 = kRows * kPlane64;
  extern __shared__ __align__(16) unsigned char smem[];
  const bool values = p.u != nullptr;  // the forward pass (the backward's recomputation needs no U)
  // k's and v's raw rows issued before load_info (ChunkBlock's early), so that they fly during its
  // dependent loads and scan (issued after it, they waited three round trips to start).
  const ChunkBlock<PreparePlanesSmem, DimsT> b(p, smem, [&](const PreparePlanesSmem& m, int64_t) {
    const int64_t* slots = p.slots + static_cast<int64_t>(blockIdx.x) * kRows;
    const EarlyRows k{m.k, static_cast<const __nv_bfloat16*>(p.k), p.hk, static_cast<int>(blockIdx.y) / (p.hv / p.hk)};
    if (values)
      load_rows_early<false, kT>(slots, p.T, k, EarlyRows{m.v, static_cast<const __nv_bfloat16*>(p.v), p.hv,
                                                          static_cast<int>(blockIdx.y)});
    else
      load_rows_early<false, kT>(slots, p.T, k);
  });
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t rows = b.rows;
  const int h = b.h, tid = threadIdx.x;
  wait_copies();
  __syncthreads();
  row_rnorms<kT>(m.rk, m.k, kPlaneRow);
  __syncthreads();
  plane_gemm<2, false, true, true, true, kNever, kNever, Tri::kLowerC, kT>(
      m.k, kPlaneRow, 0, m.k, kPlaneRow, 0, kRows, kRows, DimsT::dk, [&](int r, int c, float v0, float v1) {
        // columns c and c + 1 a call: 8-byte stores, whole sectors of kkl
        const float k0 = c < r ? v0 * m.rk[r] * m.rk[c] * decay(s, r, c) : 0.0f;
        const float k1 = c + 1 < r ? v1 * m.rk[r] * m.rk[c + 1] * decay(s, r, c + 1) : 0.0f;
        *reinterpret_cast<float2*>(m.A + r * kPitch64 + c) = make_float2(s.beta[r] * k0, s.beta[r] * k1);
        if (p.kkl != nullptr) store2(p.kkl + (rows + r) * kRows + c, k0, k1);
      });
  __syncthreads();
  {  // K~ = exp(G_63 - G) K as bfloat16 (K = k r_k, load_normalised's order), and gamma
    auto* k_tilde = reinterpret_cast<__nv_bfloat16*>(p.k_tilde + rows * DimsT::dk);
    for (int idx = tid; idx < kRows * DimsT::dk / 2; idx += kT) {
      const int i = idx / (DimsT::dk / 2), c = idx % (DimsT::dk / 2) * 2;
      const float2 x = unpack2<__nv_bfloat16>(*reinterpret_cast<const uint32_t*>(m.k + i * kPlaneRow + c));
      *reinterpret_cast<uint32_t*>(k_tilde + i * DimsT::dk + c) =
          pack2<__nv_bfloat16>(s.Kt[i] * (x.x * m.rk[i]), s.Kt[i] * (x.y * m.rk[i]));
    }
    if (tid == 0) p.gamma[b.chunk * p.hv + h] = s.gamma;
  }
  // Ai = (I + A)^-1 by blocks of 16 rows, a thread 16 rows (i0..) of one column (c): block st solves
  // its diagonal block, hands its rows over shared memory, and each later block takes them out of its
  // own (16 x 16 products), so that every warp works and the serial chain is four blocks' long, not
  // 64 rows' (a thread a column took 64 threads and half the kernel's instructions). Rows above the
  // column's diagonal are zero: their threads skip.
  const int c = tid % kRows, i0 = tid / kRows * 16;
  float x[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) x[r] = i0 + r == c ? 1.0f : 0.0f;
  for (int st = 0; st < kRows; st += 16) {
    if (i0 == st && c < st + 16) {
      diagonal_solve(x, m.A, m.Ai, i0, c);
    }
    __syncthreads();
    if (i0 > st && c < st + 16) {
      float y[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) y[j] = m.Ai[(st + j) * kPitch64 + c];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float* a = m.A + (i0 + r) * kPitch64 + st;
        float acc[2] = {x[r], 0.0f};
#pragma unroll
        for (int j = 0; j < 16; j += 4) {
          const float4 a4 = *reinterpret_cast<const float4*>(a + j);
          acc[0] = fmaf(-a4.x, y[j], acc[0]);
          acc[1] = fmaf(-a4.y, y[j + 1], acc[1]);
          acc[0] = fmaf(-a4.z, y[j + 2], acc[0]);
          acc[1] = fmaf(-a4.w, y[j + 3], acc[1]);
        }
        x[r] = acc[0] + acc[1];
      }
    }
  }
  // M's planes from the registers, over A and Ai (every read of them was before the last block's
  // barrier): Ai with column c scaled by beta_c (U's) and by beta_c E_c r_k,c (W's).
  const float bu = s.beta[c], bw = s.beta[c] * s.E[c] * m.rk[c];
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int i = i0 + r;
    if (values) store_split1(m.mu + i * kPlane64 + c, kLo64, x[r] * bu);
    store_split1(m.mw + i * kPlane64 + c, kLo64, x[r] * bw);
    if (p.ai != nullptr) p.ai[(rows + i) * kRows + c] = x[r];
  }
  __syncthreads();
  if (values)
    plane_gemm<4, false, false, true, false, kNever, kNever, Tri::kLowerA, kT>(
        m.mu, kPlane64, kLo64, m.v, kPlaneRow, 0, kRows, DimsT::dv, kRows,
        [&](int r, int col, float x0, float x1) {  // bfloat16 (tools/delta_rule_split_check.py --stored u)
          *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(p.u) + (rows + r) * DimsT::dv + col) =
              pack2<__nv_bfloat16>(x0, x1);
        });
  auto* w = reinterpret_cast<__nv_bfloat16*>(p.w + rows * DimsT::dk);
  plane_gemm<4, false, false, true, false, kNever, kNever, Tri::kLowerA, kT>(
      m.mw, kPlane64, kLo64, m.k, kPlaneRow, 0, kRows, DimsT::dk, kRows, [&](int r, int col, float x0, float x1) {
        *reinterpret_cast<uint32_t*>(w + r * DimsT::dk + col) = pack2<__nv_bfloat16>(x0, x1);
      });
}

// The recurrence across chunks (gdr::Recurrence), a block per 32 columns of a document's head:
// x = base + sign_a a S and S = decay S + add + sign_b b^T x as two block products a chunk, the next
// chunk's tiles (a, b, base, add) loading (cp.async; on planes the base into registers) while this one
// computes.
struct RecurrenceArgs {
  const void* base;  // float32; bfloat16 for the folded plane kernels (dv_local)
  const float *a, *b, *add, *decay;
  void* state_out;  // float32; bfloat16 on planes (recurrence_planes_kernel, recurrence_wgmma_kernel)
  void* x_out;  // float32; bfloat16 on planes (v_new, dv_new)
  const int64_t *chunks_of, *offset;
  float sign_a, sign_b;
  int heads, dk, dv;
  bool reverse;
  // add folded in (on planes, kFold): a chunk's add is eq^T d_o, eq [C, H, 64,
  // Dk] bfloat16 (E Q as local_grads rounded it), d_o [T, H, Dv] bfloat16 rows by slots (zero past T).
  const __nv_bfloat16 *eq, *d_o;
  const int64_t* slots;
  int64_t T;
};

constexpr int kCols = 32, kColPitch = kCols + 8;

// The recurrence's base on planes, U (forward) or dv_local (the folded backward), is bfloat16: a
// thread's pair of it as it lies (uint32_t), widened to float32.
__device__ __forceinline__ float2 widen(uint32_t v) { return unpack2<__nv_bfloat16>(v); }

// The index of document blockIdx.z's i-th chunk in the recurrence's order (last first where
// p.reverse); 0 past its `chunks`.
__device__ __forceinline__ int64_t chunk_at(const RecurrenceArgs& p, int64_t chunks, int64_t i) {
  return i < chunks ? p.offset[p.reverse ? chunks - 1 - i : i] + blockIdx.z : 0;
}

// A chunk's base [64, 32] and add [pk, 32] (if any) for the block's columns col0.. (ncols of them).
template <typename DimsT>
__device__ __forceinline__ void load_base_add(float* base, float* add, const RecurrenceArgs& p, int64_t head, int col0,
                                              int ncols, const DimsT& d) {
  load_block(base, kCols, static_cast<const float*>(p.base) + head * kRows * d.dv + col0, d.dv, kRows, ncols, kRows,
             kCols);
  if (p.add != nullptr) load_block(add, kCols, p.add + head * d.dk * d.dv + col0, d.dv, d.dk, ncols, d.pk, kCols);
}

// The chunk loop of both recurrence kernels, over document blockIdx.z's chunks in order (last first
// where p.reverse): each chunk's tiles loaded a step ahead (load(stage, chunk), asynchronous
// copies), then step(head, stage, decay) once they are in. A step's own work between its barriers
// is its critical path (stop 30's profile: 58-61% of the samples before the second barrier, mostly
// addresses and scalar stores): the next chunk's index is read before the wait. ahead(chunk) is
// called a step before load(stage, chunk), for what load needs read from global memory first (so
// that its latency passes under a step, not on the critical path); the chunk after next's index is
// read with the next one's. turn() is called at each step before load(), for what load hands over in
// registers (a thread's values of the next chunk, read a step ahead). The chunk decay is read at its
// own step's start: read a step ahead instead (40e471b), the forward's recurrence took 1.16 ms at
// 32K tokens against 1.05 and the reverse's gained nothing (H100, twenty-ninth session).
template <typename Load, typename Step, typename Ahead, typename Turn>
__device__ __forceinline__ void over_chunks(const RecurrenceArgs& p, int h, Load&& load, Step&& step, Ahead&& ahead,
                                            Turn&& turn) {
  const int64_t doc = blockIdx.z, chunks = p.chunks_of[doc];
  const auto chunk_at = [&](int64_t i) { return v4::gdr::chunk_at(p, chunks, i); };
  int64_t chunk = chunk_at(0), next = chunk_at(1);
  if (chunks > 0) {
    ahead(chunk);
    load(0, chunk);
  }
  if (chunks > 1) ahead(next);
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t head = chunk * p.heads + h, after = chunk_at(i + 2);
    const int stage = i % 2;
    const float dec = p.decay[head];
    wait_copies();
    __syncthreads();  // this step's tiles are in; the last step's reads of the other stage are done
    turn();
    if (i + 1 < chunks) load(1 - stage, next);
    if (i + 2 < chunks) ahead(after);
    step(head, stage, dec);
    chunk = next;
    next = after;
  }
}
template <typename Load, typename Step>
__device__ __forceinline__ void over_chunks(const RecurrenceArgs& p, int h, Load&& load, Step&& step) {
  over_chunks(p, h, load, step, [](int64_t) {}, [] {});
}

// Two stages of a [64, pk + 4], b [64, pk + 8], base [64, 32], add [pk, 32]; S [pk, 40]; X [64, 40].
struct RecurrenceSmem {
  float *a, *b, *base, *add, *S, *X;
  int lda, ldb;
  template <typename DimsT>
  __host__ __device__ RecurrenceSmem(Carve& c, const DimsT& d) : lda(d.pk + 4), ldb(d.pk + 8) {
    a = c.take<float>(2 * kRows * lda);
    b = c.take<float>(2 * kRows * ldb);
    base = c.take<float>(2 * kRows * kCols);
    add = c.take<float>(2 * d.pk * kCols);
    S = c.take<float>(d.pk * kColPitch);
    X = c.take<float>(kRows * kColPitch);
  }
};

template <Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kThreads) recurrence_kernel(RecurrenceArgs p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const DimsT d = dims_of<DimsT>(p.dk, p.dv);
  Carve carve{smem};
  const RecurrenceSmem m(carve, d);
  const int col0 = blockIdx.x * kCols, ncols = d.dv % kCols == 0 ? kCols : min(kCols, d.dv - col0);
  const int h = blockIdx.y, tid = threadIdx.x;
  for (int i = tid; i < d.pk * kColPitch; i += kThreads) m.S[i] = 0.0f;  // S = 0; its padding stays 0
  for (int i = tid; i < kRows * kColPitch; i += kThreads) m.X[i] = 0.0f;
  const auto load = [&](int stage, int64_t chunk) {
    const int64_t head = chunk * p.heads + h;
    load_block(m.a + stage * kRows * m.lda, m.lda, p.a + head * kRows * d.dk, d.dk, kRows, d.dk, kRows, d.pk);
    load_block(m.b + stage * kRows * m.ldb, m.ldb, p.b + head * kRows * d.dk, d.dk, kRows, d.dk, kRows, d.pk);
    load_base_add(m.base + stage * kRows * kCols, m.add + stage * d.pk * kCols, p, head, col0, ncols, d);
    commit_copies();
  };
  // The state and x go out four floats a store after their products, from shared memory, and the
  // first product's epilogue only writes shared memory (the step's critical path: over_chunks).
  over_chunks(p, h, load, [&](int64_t head, int stage, float dec) {
    store_block(static_cast<float*>(p.state_out) + head * d.dk * d.dv + col0, d.dv, m.S, kColPitch, d.dk, ncols);
    const float *a = m.a + stage * kRows * m.lda, *b = m.b + stage * kRows * m.ldb;
    const float *base = m.base + stage * kRows * kCols, *add = m.add + stage * d.pk * kCols;
    block_gemm<1, false, false, kMode>(a, m.lda, m.S, kColPitch, kRows, ncols, d.dk, [&](int r, int c, float v) {
      m.X[r * kColPitch + c] = base[r * kCols + c] + p.sign_a * v;
    });
    __syncthreads();
    store_block(static_cast<float*>(p.x_out) + head * kRows * d.dv + col0, d.dv, m.X, kColPitch, kRows, ncols);
    block_gemm<2, true, false, kMode>(b, m.ldb, m.X, kColPitch, d.dk, ncols, kRows, [&](int r, int c, float v) {
      float s = dec * m.S[r * kColPitch + c] + p.sign_b * v;
      if (p.add != nullptr) s += add[r * kCols + c];
      m.S[r * kColPitch + c] = s;
    });
    __syncthreads();
  });
}

// The recurrence on bfloat16 operands (kPlanes): a and b two stages of [64, pk + 8] bfloat16 (W and
// K~ as prepare rounded them; rows 16-byte aligned, 16 bytes apart in the banks: ldmatrix without
// conflicts), base in registers (below); S and x rounded once to bfloat16 for the products ([pk, 40] and
// [64, 40]), one bf16 product each (fla's precision). The state itself stays in float32, in the
// registers of the warps whose second-product tiles hold it, and so does x written out; the state
// written out (h, or the backward's d_state) is rounded to bfloat16, as its readers take it.
// No add on planes: the forward has none, and the backward's is formed in the kernel (kFold: two
// stages of eq [64, pk + 8] and d_o [64, 40] bfloat16). The base comes in registers: a thread's four
// values of its x tile, read a step ahead (from shared memory they were a 4-way bank conflict on the
// step's critical path; ncu of the H100, 2026-12-06). 32 columns on 16 warps is the fastest of three
// shapes timed in one process (H100, thirtieth session; the same bits): 64 columns a block (two blocks
// a head, L2's traffic a step 7.1 -> 5.1 MB) took the forward's recurrence 1.02 -> 1.43 ms at 32K
// tokens, and fla's block shape (4 warps at 32 columns) 1.10 ms, the folded backward's 1.57 against 1.28.
constexpr int kPlanePitch = kCols + 8;
template <bool kFold>
struct PlanesSmem {
  __nv_bfloat16 *a, *b, *S, *X, *eq = nullptr, *d_o = nullptr;
  int lda;
  template <typename DimsT>
  __host__ __device__ PlanesSmem(Carve& c, const DimsT& d) : lda(d.pk + 8) {
    a = c.take<__nv_bfloat16>(2 * kRows * lda);
    b = c.take<__nv_bfloat16>(2 * kRows * lda);
    if constexpr (kFold) {
      eq = c.take<__nv_bfloat16>(2 * kRows * lda);
      d_o = c.take<__nv_bfloat16>(2 * kRows * kPlanePitch);
    }
    S = c.take<__nv_bfloat16>(d.pk * kPlanePitch);
    X = c.take<__nv_bfloat16>(kRows * kPlanePitch);
  }
};

// x = base + sign_a a S, then S = decay S + add + sign_b b^T x, as recurrence_kernel, 16 warps: the
// first product a warp a 16 x 8 tile of x [64, 32] (K = pk), the second a 16 x 16 tile of S [pk, 32]
// (K = 64), which that warp's lanes keep in float32 from chunk to chunk. kFold: add = eq^T d_o, the
// same tile of a third product, formed before x is in (it needs neither x nor S).
template <typename DimsT, bool kFold>
__global__ void __launch_bounds__(kThreads) recurrence_planes_kernel(RecurrenceArgs p) {
  static_assert(kWarps == 16 && kCols == 32, "a warp a tile of x [64, 32] and of S [128, 32]");
  extern __shared__ __align__(16) unsigned char smem[];
  const DimsT d{};
  static_assert(DimsT::dk == 128 && DimsT::pk == 128 && DimsT::dv % kCols == 0, "Qwen3.5's widths");
  Carve carve{smem};
  const PlanesSmem<kFold> m(carve, d);
  const int col0 = blockIdx.x * kCols, h = blockIdx.y, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  constexpr int kTile = kRows * (DimsT::pk + 8);
  for (int i = tid; i < DimsT::pk * kPlanePitch; i += kThreads) m.S[i] = __float2bfloat16_rn(0.0f);
  // This warp's tiles: x rows x0.. (16) and columns xc.. (8); S rows s0.. (16) and columns sc.. (16).
  const int x0 = warp / 4 * 16, xc = warp % 4 * 8, s0 = warp / 2 * 16, sc = warp % 2 * 16;
  float state[2][4] = {};  // S at (s0 + g + 8 (e / 2), sc + 8 j + 2 t + e % 2)
  int64_t tok = 0;  // kFold: ahead()'s
  // The copies' places, the same each chunk (their index arithmetic was 40% of a step's instructions;
  // ncu, 2026-12-06): a, b (and eq) are 64 rows of pk bfloat16 each, contiguous in global memory, two
  // 16-byte pieces a thread (rows r and r + 32, piece tid % 16).
  constexpr int kLda = DimsT::pk + 8, kPieces = DimsT::pk / 8, kPass = kThreads / kPieces;
  static_assert(kRows == 2 * kPass, "two pieces a thread");
  const int to_smem = tid / kPieces * kLda + tid % kPieces * 8, to_rows = tid / kPieces * DimsT::dk + tid % kPieces * 8;
  // The base [64, 32] (U, or the backward's dv_local in bfloat16): this thread's four values of its x
  // tile (rows x0 + g and + 8, columns xc + 2 t and + 1), read a step ahead into `next_base` as they
  // lie (widened there, the read would be waited on at once), turned into `base`.
  const int base_at = (x0 + g) * DimsT::dv + col0 + xc + 2 * t;
  float2 base[2] = {};
  uint32_t next_base[2] = {};
  const auto load = [&](int stage, int64_t chunk) {
    const int64_t head = chunk * p.heads + h;
    const auto* a = reinterpret_cast<const __nv_bfloat16*>(p.a + head * kRows * d.dk) + to_rows;
    const auto* b = reinterpret_cast<const __nv_bfloat16*>(p.b + head * kRows * d.dk) + to_rows;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int s_at = stage * kTile + to_smem + u * kPass * kLda, g_at = u * kPass * DimsT::dk;
      copy16(m.a + s_at, a + g_at);
      copy16(m.b + s_at, b + g_at);
      if constexpr (kFold) copy16(m.eq + s_at, p.eq + head * kRows * d.dk + to_rows + g_at);
    }
    if constexpr (kFold) {  // d_o's rows of the block's 32 columns, 16 bytes a thread (zero past T)
      static_assert(kRows * kCols / 8 <= kThreads, "a piece a thread: its slot read a step ahead");
      if (tid < kRows * kCols / 8) {
        const int r = tid / (kCols / 8), c = tid % (kCols / 8) * 8;
        __nv_bfloat16* to = m.d_o + stage * kRows * kPlanePitch + r * kPlanePitch + c;
        if (tok < p.T) copy16(to, p.d_o + (tok * p.heads + h) * d.dv + col0 + c);
        else *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
      }
    }
    const auto* from = static_cast<const __nv_bfloat16*>(p.base) + head * kRows * d.dv + base_at;  // (no add on planes)
    next_base[0] = *reinterpret_cast<const uint32_t*>(from);
    next_base[1] = *reinterpret_cast<const uint32_t*>(from + 8 * DimsT::dv);
    commit_copies();
  };
  // kFold: the token of this thread's d_o row in the chunk load() takes next, read a step ahead.
  const auto ahead = [&](int64_t chunk) {
    if (kFold && tid < kRows * kCols / 8) tok = p.slots[chunk * kRows + tid / (kCols / 8)];
  };
  // (over_chunks' barrier also makes the last step's bfloat16 S visible.)
  over_chunks(p, h, load, [&](int64_t head, int stage, float dec) {
    // The state out rounded to bfloat16 as the products take it (and dgamma's dot reads it).
    // Eight bytes a lane (half sectors were written four bytes a lane): lanes t and t ^ 1 swap a pair,
    // so that the even one holds columns sc + 2 t.. + 3 and the odd one sc + 8 + 2 (t - 1).. + 3.
    __nv_bfloat16* h_out = static_cast<__nv_bfloat16*>(p.state_out) + head * d.dk * d.dv + col0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t p0 = pack2<__nv_bfloat16>(state[0][2 * half], state[0][2 * half + 1]);
      const uint32_t p1 = pack2<__nv_bfloat16>(state[1][2 * half], state[1][2 * half + 1]);
      const bool odd = t & 1;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? p0 : p1, 1);
      const int r = s0 + g + 8 * half, c = sc + (odd ? 8 : 0) + 2 * (t & ~1);
      *reinterpret_cast<uint2*>(h_out + r * d.dv + c) = odd ? make_uint2(got, p1) : make_uint2(p0, got);
    }
    // x = base + sign_a a S: A = a [64, pk] (ldmatrix), B = S [pk, 32] (ldmatrix.trans).
    {
      const __nv_bfloat16* a = m.a + stage * kTile;
      float acc[4] = {};
#pragma unroll
      for (int k0 = 0; k0 < DimsT::pk; k0 += 16) {
        uint32_t fa[4], fb[2];
        ldsm_x4(fa, a + (x0 + lane % 16) * kLda + k0 + lane / 16 * 8);
        ldsm_x2_t(fb, m.S + (k0 + lane % 16) * kPlanePitch + xc);
        mma16816<__nv_bfloat16>(acc, fa, fb);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = x0 + g + 8 * half, c = xc + 2 * t;
        const float v0 = base[half].x + p.sign_a * acc[2 * half];
        const float v1 = base[half].y + p.sign_a * acc[2 * half + 1];
        const uint32_t x2 = pack2<__nv_bfloat16>(v0, v1);
        const int64_t at = (head * kRows + r) * d.dv + col0 + c;
        // v_new (forward) and dv_new (backward) as the products take them, bfloat16: the output's P
        // v_new and dqkwg's d_o v_new^T read v_new exact, dqkwg's dw and wy_grads' dR and Y dv_new
        // (tools/delta_rule_split_check.py --stored v_new,dv_new)
        *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(p.x_out) + at) = x2;
        *reinterpret_cast<uint32_t*>(m.X + r * kPlanePitch + c) = x2;
      }
    }
    // This warp's 16 x 16 tile of S's shape from a [64, pk] tile read transposed (A^T, ldmatrix.trans;
    // pitch kLda) times a [64, 32] tile (B): b^T x, and the backward's eq^T d_o.
    const auto transposed_product = [&](float (&acc)[2][4], const __nv_bfloat16* A, const __nv_bfloat16* B) {
#pragma unroll
      for (int k0 = 0; k0 < kRows; k0 += 16) {
        uint32_t fa[4], fb[4];
        ldsm_x4_t(fa, A + (k0 + lane % 8 + lane / 16 * 8) * kLda + s0 + lane / 8 % 2 * 8);
        ldsm_x4_t(fb, B + (k0 + lane % 16) * kPlanePitch + sc + lane / 16 * 8);
#pragma unroll
        for (int j = 0; j < 2; ++j) mma16816<__nv_bfloat16>(acc[j], fa, {fb[2 * j], fb[2 * j + 1]});
      }
    };
    float folded[2][4] = {};  // kFold: this warp's tile of add = eq^T d_o (as b^T x below)
    if constexpr (kFold) transposed_product(folded, m.eq + stage * kTile, m.d_o + stage * kRows * kPlanePitch);
    __syncthreads();  // x is in; every read of S is done
    // S = decay S + add + sign_b b^T x: A = b^T (ldmatrix.trans of b [64, pk]), B = x [64, 32].
    {
      float acc[2][4] = {};
      transposed_product(acc, m.b + stage * kTile, m.X);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          state[j][e] = dec * state[j][e] + p.sign_b * acc[j][e];
          if constexpr (kFold) state[j][e] += folded[j][e];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = s0 + g + 8 * half, c = sc + 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(m.S + r * kPlanePitch + c) = pack2<__nv_bfloat16>(state[j][2 * half],
                                                                                      state[j][2 * half + 1]);
        }
      }
    }
  }, ahead, [&] {
    base[0] = widen(next_base[0]);
    base[1] = widen(next_base[1]);
  });
}

// The recurrence of recurrence_planes_kernel on Hopper's warpgroup products (wgmma): one warpgroup a
// block of 32 columns. The two products read their operands from shared memory in the tensor core,
// once a warpgroup, where the 16 warps' ldmatrix fragments read a and S four times over and waited on
// shared memory for 45% of the forward's samples (ncu of the H100, thirty-fourth session: 3,478 cycles a
// chunk, shared memory 67% busy). a, b (and kFold's eq) come `stages` deep in 128-byte swizzle, the
// base [64, 32] (U, kFold's dv_local: bfloat16) and kFold's d_o beside them; S [pk, 32]
// and x [64, 32] are bfloat16 MN-major operands, the first 64 bytes of 128-byte swizzled rows. x is
// written into shared memory as sign_b x (negation is exact), so that the second product's sum is the
// one the state adds; kFold's eq^T d_o adds into the same accumulator. The state stays in float32 in
// the accumulator's registers.
constexpr int kWgThreads = 128, kBasePitch = kCols + 8;  // (pitch 40: a warp's pairs read in the fewest wavefronts)
constexpr int kWgTile = kRows * 128 * 2;                 // [64, 128] bfloat16
template <bool kFold>
struct WgRecurrenceSmem {
  static constexpr int stages = kFold ? 3 : 4;  // as deep as 227 KB allows
  unsigned char *a, *b, *eq = nullptr, *d_o = nullptr, *S, *X;
  __nv_bfloat16* base;
  float* decay;   // each stage's chunk decay
  int64_t* head;  // each stage's chunk * heads + h
  template <typename DimsT>
  __host__ __device__ WgRecurrenceSmem(Carve& c, const DimsT& d) {
    static_assert(kWgTile % 1024 == 0 && kRows * 128 % 1024 == 0, "tiles on 1,024 bytes, as the swizzle wants");
    a = c.take<unsigned char>(stages * kWgTile);
    b = c.take<unsigned char>(stages * kWgTile);
    if constexpr (kFold) {
      eq = c.take<unsigned char>(stages * kWgTile);
      d_o = c.take<unsigned char>(stages * kRows * 128);
    }
    S = c.take<unsigned char>(d.pk * 128);
    X = c.take<unsigned char>(kRows * 128);
    base = c.take<__nv_bfloat16>(stages * kRows * kBasePitch);
    decay = c.take<float>(stages);
    head = c.take<int64_t>(stages);
    c.take<unsigned char>(1024);  // the slack of the kernel's alignment to 1,024 bytes
  }
};

template <typename DimsT, bool kFold>
__global__ void __launch_bounds__(kWgThreads, 1) recurrence_wgmma_kernel(RecurrenceArgs p) {
#if defined(V4_HAS_WGMMA)
  static_assert(DimsT::dk == 128 && DimsT::pk == 128 && DimsT::dv % kCols == 0, "Qwen3.5's widths");
  extern __shared__ __align__(16) unsigned char smem[];
  Carve carve{wgmma::sw128_aligned(smem)};
  const WgRecurrenceSmem<kFold> m(carve, DimsT{});
  const DimsT d{};
  const int col0 = blockIdx.x * kCols, h = blockIdx.y, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t chunks = p.chunks_of[blockIdx.z];
  const auto chunk_at = [&](int64_t i) { return v4::gdr::chunk_at(p, chunks, i); };
  constexpr int kStages = WgRecurrenceSmem<kFold>::stages;
  // The products' descriptors, made once: a step moves them on by desc_add alone (made per product,
  // their masks and shifts were a quarter of a step's instructions).
  const auto desc = [](const void* tile, int lead) { return wgmma::desc128(wgmma::saddr(tile), lead, 1024); };
  const uint64_t a_desc = desc(m.a, 16), b_desc = desc(m.b, kRows * 128), S_desc = desc(m.S, DimsT::pk * 128),
                 X_desc = desc(m.X, kRows * 128), eq_desc = kFold ? desc(m.eq, kRows * 128) : 0,
                 d_o_desc = kFold ? desc(m.d_o, kRows * 128) : 0;
  // This thread's places in the copies, the same every chunk (u the copy's number): a [64, 128] tile's
  // piece tid + 128 u is 16 bytes at row tid / 16 + 8 u, global offset 8 tid + 1,024 u elements, and
  // in the swizzle (its row's place in a group of 8 the same for every u) tile_at + 1,024 u bytes.
  // base [64, 32], d_o [64, 32] and S's rows for the state out: row tid / 4 + 32 u, column tid % 4 * 8,
  // in the swizzle (d_o, S) rows_at + 4,096 u bytes.
  const int tile_at = wgmma::sw128_offset<kRows>(tid / 16, tid % 16 * 8);
  const int rows_at = wgmma::sw128_offset<kRows>(tid / 4, tid % 4 * 8), row4 = tid / 4, col4 = tid % 4 * 8;
  static_assert(kCols == 32, "the base's rows four pieces of 16 bytes");
  const int base_from = row4 * DimsT::dv + col4, base_to = row4 * kBasePitch + col4;
  for (int i = tid; i < DimsT::pk * 128 / 16; i += kWgThreads) reinterpret_cast<uint4*>(m.S)[i] = make_uint4(0, 0, 0, 0);
  // kFold: the tokens of this thread's two d_o rows of the chunk loaded next, read a step ahead.
  int64_t tok[2] = {};
  const auto ahead = [&](int64_t i, int64_t chunk) {
    if constexpr (kFold) {
      if (i < chunks) {
        for (int u = 0; u < 2; ++u) tok[u] = p.slots[chunk * kRows + row4 + 32 * u];
      }
    }
  };
  // Chunk i's tiles into stage i % kStages: a, b (and eq) [64, 128] bfloat16, eight copies a thread of
  // each; base [64, 32] bfloat16, two; d_o [64, 32] bfloat16, two; and its head's place and decay, which
  // the step reads from shared memory (from global memory, at the step's start, their latency was
  // the step's).
  const auto load = [&](int64_t i, int64_t chunk) {
    if (i >= chunks) return;
    const int stage = i % kStages;
    const int64_t head = chunk * p.heads + h;
    if (tid == 0) {
      m.head[stage] = head;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(wgmma::saddr(m.decay + stage)), "l"(p.decay + head));
    }
    const auto tile = [&](unsigned char* to, const void* from) {  // (a and b: bfloat16 in float32's rows)
      to += stage * kWgTile + tile_at;
      const auto* rows = static_cast<const __nv_bfloat16*>(from) + 8 * tid;
#pragma unroll
      for (int u = 0; u < kRows * 16 / kWgThreads; ++u) copy16(to + 1024 * u, rows + 1024 * u);
    };
    tile(m.a, p.a + head * kRows * d.dk);
    tile(m.b, p.b + head * kRows * d.dk);
    if constexpr (kFold) {
      tile(m.eq, p.eq + head * kRows * d.dk);
#pragma unroll
      for (int u = 0; u < 2; ++u) {  // d_o's rows by slots, zero past T
        const bool real = tok[u] < p.T;
        copy16_fill(m.d_o + stage * kRows * 128 + rows_at + 4096 * u,
                    p.d_o + (real ? (tok[u] * p.heads + h) * d.dv + col0 + col4 : 0), real);
      }
    }
    const auto* base = static_cast<const __nv_bfloat16*>(p.base) + head * kRows * d.dv + col0 + base_from;
    __nv_bfloat16* to = m.base + stage * kRows * kBasePitch + base_to;
#pragma unroll
    for (int u = 0; u < 2; ++u) copy16(to + 32 * kBasePitch * u, base + 32 * DimsT::dv * u);
  };
  for (int i = 0; i < kStages - 1; ++i) {
    const int64_t chunk = chunk_at(i);
    ahead(i, chunk);
    load(i, chunk);
    commit_copies();
  }
  // The chunk indices in registers, read ahead: at step i, `next` is chunk i + kStages - 1's (loaded
  // at the step), `after` the one after it (its tokens read at the step), and `later` the one after
  // that, read at the step for the next.
  int64_t next = chunk_at(kStages - 1), after = chunk_at(kStages);
  ahead(kStages - 1, next);
  float state[2][16] = {};  // S [pk, 32]: rows 64 half + 16 warp + g (+ 8), columns 8 j + 2 t (+ 1), as [4 j + e]
  for (int64_t i = 0; i < chunks; ++i) {
    const int stage = i % kStages;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));  // chunk i's copies are in
    wgmma::fence_shared();
    __syncthreads();  // and everyone's, and the last step's S; every read of the stage refilled below is done
    const int64_t head = m.head[stage];
    const float dec = m.decay[stage];
    load(i + kStages - 1, next);
    commit_copies();  // (an empty group past the last chunk: the count above stays one a chunk)
    const int64_t later = chunk_at(i + kStages + 1);
    ahead(i + kStages, after);
    next = after;
    after = later;
    // x = base + sign_a a S: a K-major, S MN-major.
    float x[16] = {};
    wgmma::fence_operand(x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < DimsT::pk / 16; ++kk)
      wgmma::mma<__nv_bfloat16, 32, 0, 1>(x, wgmma::desc_add(a_desc, stage * kWgTile + wgmma::sw128_k_step<kRows>(kk)),
                                          wgmma::desc_add(S_desc, kk * 2048));
    wgmma::commit();
    // The state out (S at the chunk's start, bfloat16 as the products take it; dgamma's dot reads it),
    // 16 bytes a copy from S's tile (the reads issued while the product runs).
    {
      __nv_bfloat16* h_out = static_cast<__nv_bfloat16*>(p.state_out) + head * d.dk * d.dv + col0 + row4 * DimsT::dv + col4;
#pragma unroll
      for (int u = 0; u < DimsT::pk * 4 / kWgThreads; ++u)  // (rows_at: S's rows of 128 bytes as a tile's)
        *reinterpret_cast<uint4*>(h_out + 32 * DimsT::dv * u) = *reinterpret_cast<const uint4*>(m.S + rows_at + 4096 * u);
    }
    wgmma::wait<0>();
    wgmma::fence_operand(x);
    {
      const __nv_bfloat16* base = m.base + stage * kRows * kBasePitch;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + g + 8 * half, c = 8 * j + 2 * t;
          const float2 b0 = widen(*reinterpret_cast<const uint32_t*>(base + r * kBasePitch + c));
          const float v0 = b0.x + p.sign_a * x[4 * j + 2 * half], v1 = b0.y + p.sign_a * x[4 * j + 2 * half + 1];
          // v_new (forward) and dv_new (backward) in bfloat16, as their readers take them
          // (tools/delta_rule_split_check.py --stored v_new,dv_new)
          *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(p.x_out) + (head * kRows + r) * d.dv + col0 + c) =
              pack2<__nv_bfloat16>(v0, v1);
          *reinterpret_cast<uint32_t*>(m.X + wgmma::sw128_offset<kRows>(r, c)) =
              pack2<__nv_bfloat16>(p.sign_b * v0, p.sign_b * v1);
        }
      }
    }
    wgmma::fence_shared();
    __syncthreads();  // x is in; every read of S is done
    // S = decay S + sign_b b^T x (+ eq^T d_o): b (and eq) MN-major as A, the halves of S's rows, x MN-major.
    float add[2][16] = {};
    wgmma::fence_operand(add[0]);
    wgmma::fence_operand(add[1]);
    wgmma::fence();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int kk = 0; kk < kRows / 16; ++kk) {
        const int at = stage * kWgTile + half * kRows * 128 + kk * 2048;  // b's (and eq's) rows kk, M half
        wgmma::mma<__nv_bfloat16, 32, 1, 1>(add[half], wgmma::desc_add(b_desc, at), wgmma::desc_add(X_desc, kk * 2048));
        if constexpr (kFold)
          wgmma::mma<__nv_bfloat16, 32, 1, 1>(add[half], wgmma::desc_add(eq_desc, at),
                                              wgmma::desc_add(d_o_desc, stage * kRows * 128 + kk * 2048));
      }
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operand(add[0]);
    wgmma::fence_operand(add[1]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          float* s = &state[half][4 * j + 2 * e2];
          s[0] = dec * s[0] + add[half][4 * j + 2 * e2];
          s[1] = dec * s[1] + add[half][4 * j + 2 * e2 + 1];
          const int r = kRows * half + 16 * warp + g + 8 * e2, c = 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(m.S + wgmma::sw128_offset<DimsT::pk>(r, c)) = pack2<__nv_bfloat16>(s[0], s[1]);
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // (no copy outlives the block)
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// P = (Q K^T) * L (lower, with the diagonal) into columns 0..63 of QP and E Q into columns 64..,
// from the chunk's queries and keys (K into `keys`, pitch pk + 4). Used by the output and
// local_grads kernels; QP's pitch suits each one's product.
template <typename T, Mode kMode, typename DimsT>
__device__ void build_qp(float* QP, int ldqp, float* keys, const Info& s, const Args& p, const DimsT& d, int h) {
  const int kh = h / (p.hv / p.hk), ldk = d.pk + 4;
  load_normalised(QP + kRows, ldqp, nullptr, static_cast<const T*>(p.q), p.hk, kh, d.dk, d.pk, p.scale, s, p.T);
  load_normalised(keys, ldk, nullptr, static_cast<const T*>(p.k), p.hk, kh, d.dk, d.pk, 1.0f, s, p.T);
  __syncthreads();
  block_gemm<2, false, true, kMode, Tri::kLowerC>(QP + kRows, ldqp, keys, ldk, kRows, kRows, d.dk,
                                                  [&](int r, int c, float v) {
                                                    QP[r * ldqp + c] = c <= r ? v * decay(s, r, c) : 0.0f;
                                                  });
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * d.pk; idx += kThreads) {
    const int i = idx / d.pk, c = idx % d.pk;
    QP[i * ldqp + kRows + c] *= s.E[i];
  }
  __syncthreads();
}

// build_qp's [P | E Q] for the plane kernels (kPlanes), split in place into planes at its pitch (200:
// ldmatrix rows 16-byte aligned). Q K^T = diag(r_q s) (q k^T) diag(r_k) from q's and k's raw bfloat16
// rows (exact: one product for block_gemm's six), which take the keys' region (`rows`, [2][64,
// kPlaneRow]); rn [128] their rsqrt norms. `rows` is free after it, and the planes are read after the
// caller's next barrier. kIssued: the caller issued the rows' copies (ChunkBlock's early).
template <typename DimsT, bool kIssued = false>
__device__ const __nv_bfloat16* build_qp_planes(float* QP, int ldqp, void* rows, float* rn, const Info& s,
                                                const Args& p, const DimsT& d, int h) {
  const int kh = h / (p.hv / p.hk);
  auto* q = static_cast<__nv_bfloat16*>(rows);
  auto* k = q + kRows * kPlaneRow;
  const auto* q_in = static_cast<const __nv_bfloat16*>(p.q);
  if constexpr (!kIssued) {
    load_rows_split(q, -1, q_in, p.hk, kh, s, p.T);
    load_rows_split(k, -1, static_cast<const __nv_bfloat16*>(p.k), p.hk, kh, s, p.T);
  }
  wait_copies();
  __syncthreads();
  {  // E Q and r_q from q's raw rows in shared memory (load_normalised's values without its second
     // read of q from global memory)
    float v[kRows / kWarps][4];
    rows_of<kThreads>(v, q, kPlaneRow);
    normalise_rows<kThreads>(v, QP + kRows, ldqp, DimsT::pk, p.scale, [&](int i) { return s.E[i]; },
                             [&](int i, float r) { rn[i] = r; });
  }
  row_rnorms(rn + kRows, k, kPlaneRow);
  __syncthreads();
  plane_gemm<2, false, true, true, true, kNever, kNever, Tri::kLowerC>(
      q, kPlaneRow, 0, k, kPlaneRow, 0, kRows, kRows, DimsT::dk, [&](int r, int c, float v) {
        QP[r * ldqp + c] = c <= r ? v * rn[r] * p.scale * rn[kRows + c] * decay(s, r, c) : 0.0f;
      });
  __syncthreads();
  split_in_place(QP, ldqp);
  return reinterpret_cast<const __nv_bfloat16*>(QP);
}

struct OutputSmem {
  Info* info;
  float *QP, *X;  // QP [64, 64 + pk + 4]; X: the keys [64, pk + 4], then [v_new; h] [64 + pk, 40]
  int ldqp;
  template <typename DimsT>
  __host__ __device__ OutputSmem(Carve& c, const DimsT& d) : ldqp(kRows + d.pk + 4) {
    info = c.take<Info>(1);
    QP = c.take<float>(kRows * ldqp);
    X = c.take<float>(larger(kRows * (d.pk + 4), (kRows + d.pk) * kColPitch));
  }
};

// o = [P | E Q] [v_new; h] for one chunk and head, 32 value columns at a time.
template <typename T, Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kThreads) output_kernel(Args p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkBlock<OutputSmem, DimsT> b(p, smem);
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t head = b.head;
  const int h = b.h;
  build_qp<T, kMode, DimsT>(m.QP, m.ldqp, m.X, s, p, d, h);
  T* o = static_cast<T*>(p.o);
  for (int c0 = 0; c0 < d.dv; c0 += kCols) {
    const int n = min(kCols, d.dv - c0);
    load_block(m.X, kColPitch, static_cast<const float*>(p.v_new) + head * kRows * d.dv + c0, d.dv, kRows, n, kRows,
               kCols);
    load_block(m.X + kRows * kColPitch, kColPitch, static_cast<const float*>(p.h) + head * d.dk * d.dv + c0, d.dv,
               d.dk, n, d.pk, kCols);
    wait_copies();
    __syncthreads();
    block_gemm<1, false, false, kMode, Tri::kLowerA>(m.QP, m.ldqp, m.X, kColPitch, kRows, n, kRows + d.pk,
                                                     [&](int r, int c, float v) {
                                                       const int64_t tok = s.slot[r];
                                                       if (tok < p.T) o[(tok * p.hv + h) * d.dv + c0 + c] =
                                                                          from_float<T>(v);
                                                     });
    __syncthreads();
  }
}

// output_kernel with its products on planes (kPlanes): [P | E Q] split in place once built (at a
// pitch of 200: ldmatrix rows 16-byte aligned), each block of kOutCols value columns of v_new and of
// h (both bfloat16 as the recurrence stored them) copied as it loads (P on planes times v_new exact,
// E Q h one bf16 product). 64 columns a pass keep all 16 warps busy (32 kept 8 of them, in twice the passes and
// barriers). q's and k's raw rows and the first pass's h are copied before load_info (ChunkBlock's
// early; q's and k's slots read from global memory): issued after it, a block's dependent loads were
// five round trips in a row (slots, g, q and k, then each pass), at 17 us a block (1.081 ms at 32K
// tokens, 62 waves of 264 blocks). So q's and k's rows lie past [v_new; h]'s hi plane (h's rows in
// flight during load_info and the Q K^T product), and rn in v_new's hi rows (read only before
// them): 112.8 KB, still two blocks a multiprocessor (2 x (112.8 + 1) of 228 KB).
struct OutputPlanesSmem {
  static constexpr int kOutCols = 64;
  static constexpr int kPitch = kOutCols + 8;  // ldmatrix rows 16-byte aligned, 16 bytes apart in the banks
  Info* info;
  float *QP, *X, *rows, *rn;  // QP [64, 200]; X: [v_new; h] bfloat16, hi [64 + pk, kPitch] (v_new's
                              // then h's rows) then (unused: v_new is exact) a lo plane [64, kPitch];
                              // `rows`: q's and k's raw rows [2][64, kPlaneRow] bfloat16 from the hi
                              // plane's end (over that lo plane);
                              // rn: q's and k's rsqrt norms [2][64] (X's first bytes)
  int ldqp;
  template <typename DimsT>
  __host__ __device__ OutputPlanesSmem(Carve& c, const DimsT& d) : ldqp(kRows + d.pk + 8) {
    info = c.take<Info>(1);
    QP = c.take<float>(kRows * ldqp);
    constexpr int kHi = (kRows + 128) * kPitch / 2;  // floats: the hi plane at pk = 128 (the kernel's)
    static_assert(kRows * kPitch / 2 >= 2 * kRows && kHi % 4 == 0, "rn in v_new's hi rows; rows 16-byte aligned");
    X = c.take<float>(larger(kHi + kRows * kPlaneRow, (kRows + d.pk + kRows) * kPitch / 2));
    rows = X + kHi;
    rn = X;
  }
};

// (split_in_place's 24 values spill one register at 64 a thread, once a block.)
template <typename DimsT>
__global__ void __launch_bounds__(kThreads, 2) output_planes_kernel(Args p) {  // two blocks a multiprocessor
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  using Smem = OutputPlanesSmem;
  constexpr int kOutCols = Smem::kOutCols, kPitch = Smem::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  const auto* h_in = static_cast<const __nv_bfloat16*>(p.h);
  const ChunkBlock<Smem, DimsT> b(p, smem, [&](const Smem& m, int64_t head) {
    const int h = blockIdx.y, kh = h / (p.hv / p.hk);
    copy_rows<kOutCols>(reinterpret_cast<__nv_bfloat16*>(m.X) + kRows * kPitch, kPitch,
                        h_in + head * DimsT::dk * DimsT::dv, DimsT::dv, DimsT::dk);  // the first pass's h (c0 = 0, below)
    auto* q = reinterpret_cast<__nv_bfloat16*>(m.rows);
    load_rows_early(p.slots + static_cast<int64_t>(blockIdx.x) * kRows, p.T,
                    EarlyRows{q, static_cast<const __nv_bfloat16*>(p.q), p.hk, kh},
                    EarlyRows{q + kRows * kPlaneRow, static_cast<const __nv_bfloat16*>(p.k), p.hk, kh});
  });
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t head = b.head;
  const int h = b.h;
  const __nv_bfloat16* qp = build_qp_planes<DimsT, true>(m.QP, m.ldqp, m.rows, m.rn, s, p, d, h);
  auto* x = reinterpret_cast<__nv_bfloat16*>(m.X);
  constexpr int kLo = (kRows + DimsT::pk) * kPitch;
  auto* o = static_cast<__nv_bfloat16*>(p.o);
  for (int c0 = 0; c0 < d.dv; c0 += kOutCols) {
    copy_rows<kOutCols>(x, kPitch, static_cast<const __nv_bfloat16*>(p.v_new) + head * kRows * d.dv + c0, d.dv, kRows);
    if (c0 > 0) copy_rows<kOutCols>(x + kRows * kPitch, kPitch, h_in + head * d.dk * d.dv + c0, d.dv, d.dk);
    wait_copies();
    __syncthreads();
    // P on planes times v_new (bfloat16, exact: two products), E Q h on bfloat16 operands (k from 64 on: the
    // site q S, one product)
    plane_gemm<2, false, false, true, false, kRows>(qp, m.ldqp, kRows * m.ldqp, x, kPitch, kLo, kRows, kOutCols,
                                                     kRows + d.pk,
                                [&](int r, int c, float v0, float v1) {
                                  const int64_t tok = s.slot[r];
                                  if (tok < p.T)
                                    *reinterpret_cast<__nv_bfloat162*>(o + (tok * p.hv + h) * d.dv + c0 + c) =
                                        __floats2bfloat162_rn(v0, v1);
                                });
    __syncthreads();
  }
}

// ---- The per-chunk products on Hopper's warpgroup products (sm_90a): one warpgroup (kWgThreads) a
// chunk and head, the operands in 128-byte swizzle ([64, 128] bfloat16 tiles, 16 KB), the [64, 64]
// products' accumulators turned into the next products' A registers as they lie (columns 16 kk.. of an
// accumulator are slice kk's fragment). Helpers of output_wgmma_kernel and local_wgmma_kernel.

constexpr int kWgTileBytes = kRows * 256;  // a [64, 128] bfloat16 tile
constexpr int kWgPitch = 128 + 8;          // a staged [64, 128] result's rows (bfloat16): 16 bytes apart in the banks

// A thread's copies of a [64, 128] tile: 16 bytes at rows wg_row() + 8 u (u < 8), columns wg_col()..
__device__ __forceinline__ int wg_row() { return threadIdx.x / 16; }
__device__ __forceinline__ int wg_col() { return threadIdx.x % 16 * 8; }

// The chunk's rows of x [T, heads, 128] (head `head`) by slot, zeros past T, into `tile` (cp.async:
// the caller commits).
__device__ __forceinline__ void wg_rows_by_slot(unsigned char* tile, const __nv_bfloat16* x, int heads, int head,
                                                const Args& p) {
  const int c = wg_col();
#pragma unroll
  for (int u = 0; u < kRows / 8; ++u) {
    const int r = wg_row() + 8 * u;
    const int64_t tok = p.slots[static_cast<int64_t>(blockIdx.x) * kRows + r];
    const bool in = tok < p.T;
    copy16_fill(tile + wgmma::sw128_offset<kRows>(r, c), x + ((in ? tok : 0) * heads + head) * 128 + c, in);
  }
}

// rows [rows, 128] bfloat16 (contiguous) into `tile` (sw128_offset<rows>; cp.async: the caller commits).
template <int kTileRows>
__device__ __forceinline__ void wg_rows(unsigned char* tile, const __nv_bfloat16* rows) {
  const int c = wg_col();
#pragma unroll
  for (int u = 0; u < kTileRows / 8; ++u) {
    const int r = wg_row() + 8 * u;
    copy16(tile + wgmma::sw128_offset<kTileRows>(r, c), rows + r * 128 + c);
  }
}

// rn[i] = rsqrt(|q_i|^2 + 1e-6), rn[64 + i] likewise of k, from their tiles, a thread a row (the squares
// summed in column order: row_rnorm's lanes sum in another, so an ulp from the other kernels' norms).
__device__ __forceinline__ void wg_row_rnorms(float* rn, const unsigned char* q, const unsigned char* k) {
  const int r = threadIdx.x % kRows;
  const unsigned char* x = threadIdx.x < kRows ? q : k;
  float ss = 0.0f;
#pragma unroll
  for (int c8 = 0; c8 < 16; ++c8) {
    const uint4 v = *reinterpret_cast<const uint4*>(x + wgmma::sw128_offset<kRows>(r, 8 * c8));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = widen(w[i]);
      ss = fmaf(f.x, f.x, ss);
      ss = fmaf(f.y, f.y, ss);
    }
  }
  rn[threadIdx.x] = rsqrtf(ss + 1e-6f);
}

// The m64nN product a b^T of two K-major tiles (A's 64 rows, B's N = 2 kHalf rows: 128 columns each)
// into acc: issued and committed, the caller waits.
template <int kHalf>
__device__ __forceinline__ void wg_gram(float (&acc)[kHalf], const unsigned char* a, const unsigned char* b) {
  const uint64_t a_desc = wgmma::desc128(wgmma::saddr(a), 16, 1024), b_desc = wgmma::desc128(wgmma::saddr(b), 16, 1024);
  wgmma::fence_operand(acc);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < 128 / 16; ++kk)
    wgmma::mma<__nv_bfloat16, 2 * kHalf, 0, 0>(acc, wgmma::desc_add(a_desc, wgmma::sw128_k_step<kRows>(kk)),
                                               wgmma::desc_add(b_desc, wgmma::sw128_k_step<2 * kHalf>(kk)));
  wgmma::commit();
}

// f(r, c, i) for each pair of an m64nN accumulator's registers (N = 2 kHalf): i and i + 1 hold row r
// (16 warp + g, + 8), columns c and c + 1 (8 j + 2 t).
template <int kHalf, typename F>
__device__ __forceinline__ void wg_pairs(F&& f) {
  const int lane = threadIdx.x % 32, r0 = 16 * (threadIdx.x / 32) + lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kHalf / 4; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) f(r0 + 8 * half, 8 * j + 2 * t, 4 * j + 2 * half);
}

// Row r's pair of columns (c, c + 1) of a [64, 128] bfloat16 tile in 128-byte swizzle, as floats.
__device__ __forceinline__ float2 wg_pair(const unsigned char* tile, int r, int c) {
  return widen(*reinterpret_cast<const uint32_t*>(tile + wgmma::sw128_offset<kRows>(r, c)));
}

// P's element (query r, key c) from its raw dot x = q_r . k_c: build_qp_planes' scaling (r_q, scale, r_k,
// the decay), in the lower triangle with its diagonal.
__device__ __forceinline__ float wg_p(const float* rn, float scale, const Info& s, int r, int c, float x) {
  return c <= r ? x * rn[r] * scale * rn[kRows + c] * decay(s, r, c) : 0.0f;
}

// E Q's element from q's raw x in row r: normalise_rows' order (x r_q scale E).
__device__ __forceinline__ float wg_eq(const float* rn, float scale, const Info& s, int r, float x) {
  return x * rn[r] * scale * s.E[r];
}

// A [64, 64] accumulator (rows 16 warp + g (+8), columns 8 j + 2 t (+1): acc[4 j + 2 half + e]) as the hi
// and lo bfloat16 planes of the next product's A fragments, value(row, col, x) giving each element from
// its accumulator x: slice kk's register i holds row 16 warp + g + 8 (i % 2), columns 16 kk + 8 (i / 2) +
// 2 t (+1), so j = 2 kk + i / 2 and half = i % 2.
template <typename Value>
__device__ __forceinline__ void wg_planes(uint32_t (&hi)[kRows / 16][4], uint32_t (&lo)[kRows / 16][4],
                                          const float (&acc)[kRows / 2], Value&& value) {
  const int lane = threadIdx.x % 32, r0 = 16 * (threadIdx.x / 32) + lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + 8 * half, c = 8 * j + 2 * t;
      const float v0 = value(r, c, acc[4 * j + 2 * half]), v1 = value(r, c + 1, acc[4 * j + 2 * half + 1]);
      const uint32_t h = pack2<__nv_bfloat16>(v0, v1);
      const float2 hf = widen(h);
      hi[j / 2][half + 2 * (j % 2)] = h;
      lo[j / 2][half + 2 * (j % 2)] = pack2<__nv_bfloat16>(v0 - hf.x, v1 - hf.y);
    }
  }
}

// acc += P_hi b + P_lo b, P's (or P^T's) planes from wg_planes times b [64 tokens, 128] MN-major (its
// 64-column blocks 64 rows of 128 bytes apart): issued, not committed (the caller fences before).
__device__ __forceinline__ void wg_planes_times(float (&acc)[64], const uint32_t (&hi)[kRows / 16][4],
                                                const uint32_t (&lo)[kRows / 16][4], const unsigned char* b) {
  const uint64_t b_desc = wgmma::desc128(wgmma::saddr(b), kRows * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    wgmma::mma_rs<__nv_bfloat16, 1, 128>(acc, hi[kk], wgmma::desc_add(b_desc, kk * 2048));
    wgmma::mma_rs<__nv_bfloat16, 1, 128>(acc, lo[kk], wgmma::desc_add(b_desc, kk * 2048));
  }
}

// acc += P_hi b + P_lo b (wg_planes_times) as one product group, complete on return.
__device__ __forceinline__ void wg_planes_times_waited(float (&acc)[64], const uint32_t (&hi)[kRows / 16][4],
                                                       const uint32_t (&lo)[kRows / 16][4], const unsigned char* b) {
  wgmma::fence_operand(acc);
  wgmma::fence();
  wg_planes_times(acc, hi, lo, b);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operand(acc);
}

// A [64, 128] accumulator (rows 16 warp + g (+8), columns 8 j + 2 t (+1)) rounded to bfloat16 into
// `staged` [64, kWgPitch]; the caller's barrier precedes the reads.
__device__ __forceinline__ void wg_stage(__nv_bfloat16* staged, const float (&acc)[64]) {
  wg_pairs<64>([&](int r, int c, int i) {
    *reinterpret_cast<uint32_t*>(staged + r * kWgPitch + c) = pack2<__nv_bfloat16>(acc[i], acc[i + 1]);
  });
}

// A [64, 128] accumulator rounded to bfloat16 into out's rows (128 apart), staged in `staged` [64,
// kWgPitch] (free of readers: the caller's barrier or waits say so) and copied 16 bytes at a time.
__device__ __forceinline__ void wg_write(__nv_bfloat16* out, const float (&acc)[64], __nv_bfloat16* staged) {
  wg_stage(staged, acc);
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kRows / 8; ++u) {
    const int r = wg_row() + 8 * u;
    *reinterpret_cast<uint4*>(out + r * 128 + wg_col()) = *reinterpret_cast<const uint4*>(staged + r * kWgPitch + wg_col());
  }
}

// out's rows [64, 128] bfloat16 (128 apart) = f(r, x) of each element x of the [64, 128] tile's row r,
// 16 bytes a copy.
template <typename F>
__device__ __forceinline__ void wg_map_rows(__nv_bfloat16* out, const unsigned char* tile, F&& f) {
#pragma unroll
  for (int u = 0; u < kRows / 8; ++u) {
    const int r = wg_row() + 8 * u;
    const uint4 v = *reinterpret_cast<const uint4*>(tile + wgmma::sw128_offset<kRows>(r, wg_col()));
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = widen(w[i]);
      w[i] = pack2<__nv_bfloat16>(f(r, x.x), f(r, x.y));
    }
    *reinterpret_cast<uint4*>(out + r * 128 + wg_col()) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// A chunk kernel's carve: q's and k's tiles ([64, 128] K-major), kExtra more tiles after them, r_q and r_k,
// Info. A [64, 128] result is staged over q's and k's bytes once no product reads them.
template <int kExtra>
struct WgChunkSmem {
  unsigned char *q, *k, *extra;
  float* rn;  // r_q [64], then r_k [64]
  Info* info;
  template <typename DimsT>
  __host__ __device__ WgChunkSmem(Carve& c, const DimsT&) {
    static_assert(kRows * kWgPitch * 2 <= 2 * kWgTileBytes, "a result staged within q's and k's bytes");
    q = c.take<unsigned char>(kWgTileBytes);
    k = c.take<unsigned char>(kWgTileBytes);
    extra = c.take<unsigned char>(kExtra * kWgTileBytes);
    rn = c.take<float>(2 * kRows);
    info = c.take<Info>(1);
    c.take<unsigned char>(1024);  // the slack of the kernel's alignment to 1,024 bytes
  }
};
using WgOutputSmem = WgChunkSmem<3>;  // extra: v_new [64 tokens, 128] MN-major, then h [128, 128] MN-major
using WgLocalSmem = WgChunkSmem<1>;   // extra: d_o [64 tokens, 128] MN-major

// The start of both kernels: q's and k's rows by slot (the first commit group; the caller's copies
// after it), Info (ChunkBlock's load_info) while they fly.
template <int kExtra, typename DimsT, typename Later>
struct WgChunkBlock : ChunkBlock<WgChunkSmem<kExtra>, DimsT> {
  __device__ WgChunkBlock(const Args& p, unsigned char* smem, Later later)
      : ChunkBlock<WgChunkSmem<kExtra>, DimsT>(p, wgmma::sw128_aligned(smem), [&](const WgChunkSmem<kExtra>& m, int64_t head) {
          const int kh = blockIdx.y / (p.hv / p.hk);
          wg_rows_by_slot(m.q, static_cast<const __nv_bfloat16*>(p.q), p.hk, kh, p);
          wg_rows_by_slot(m.k, static_cast<const __nv_bfloat16*>(p.k), p.hk, kh, p);
          commit_copies();
          later(m, head);
        }) {}
};

// Once q's and k's rows are in (kLater commit groups after theirs still in flight): acc = a b^T of two
// of their tiles (wg_gram), the norms taken while it runs; acc complete on return.
template <int kLater>
__device__ __forceinline__ void wg_gram_after_copies(float (&acc)[kRows / 2], const unsigned char* a,
                                                     const unsigned char* b, float* rn, const unsigned char* q,
                                                     const unsigned char* k) {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kLater));
  wgmma::fence_shared();
  __syncthreads();
  wg_gram(acc, a, b);
  wg_row_rnorms(rn, q, k);
  __syncthreads();  // the norms
  wgmma::wait<0>();
  wgmma::fence_operand(acc);
}

// output_planes_kernel on warpgroup products (the variant `output_wgmma`, on by default). At 32K tokens output_planes
// took 0.941 ms against fla's chunk_fwd_o 0.677 (H100, thirty-sixth session), latency-bound (43% of
// the issue slots busy, 1.2 eligible warps a scheduler): its 16 warps read each fragment from shared
// memory by ldmatrix, several warps the same one. Here q, k, v_new and h land by cp.async from the
// block's start (80 KB, two blocks a multiprocessor); Q K^T is one m64n64 product of q's and k's raw
// rows (K-major), scaled in its accumulator as build_qp_planes scales it (r_q, scale, r_k, the decay,
// the lower triangle); P's hi and lo planes times v_new (MN-major): exact, as output_planes' two
// products; E Q rounded to bf16 (the site q S, one product) from q's rows in registers times h
// (MN-major). o [64, 128] in the accumulator, staged over q's and k's bytes and written a token row at
// a time. The sums' order differs from output_planes' (one accumulator for its acc and cross): not
// bit-equal, judged against the truth.
template <typename DimsT>
__global__ void __launch_bounds__(kWgThreads, 2) output_wgmma_kernel(Args p) {
#if defined(V4_HAS_WGMMA)
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  extern __shared__ __align__(16) unsigned char smem[];
  // The copies in three groups: q and k, v_new, h.
  const auto v_h = [&](const WgOutputSmem& m, int64_t head) {
    wg_rows<kRows>(m.extra, static_cast<const __nv_bfloat16*>(p.v_new) + head * kRows * DimsT::dv);
    commit_copies();
    wg_rows<DimsT::dk>(m.extra + kWgTileBytes, static_cast<const __nv_bfloat16*>(p.h) + head * DimsT::dk * DimsT::dv);
    commit_copies();
  };
  const WgChunkBlock<3, DimsT, decltype(v_h)> b(p, smem, v_h);
  const auto& m = b.m;
  const Info& s = b.s;
  const unsigned char *v_new = m.extra, *h = m.extra + kWgTileBytes;
  float qk[kRows / 2] = {};
  wg_gram_after_copies<2>(qk, m.q, m.k, m.rn, m.q, m.k);  // Q K^T from the raw rows
  uint32_t ph[kRows / 16][4], pl[kRows / 16][4];  // P's planes: query r, key c
  wg_planes(ph, pl, qk, [&](int r, int c, float x) { return wg_p(m.rn, p.scale, s, r, c, x); });
  // E Q rounded to bfloat16, slice kk's register i at row r0 + 8 (i % 2), columns 16 kk + 8 (i / 2) + 2 t
  // (+1), from q's raw rows.
  const int lane = threadIdx.x % 32, r0 = 16 * (threadIdx.x / 32) + lane / 4, t = lane % 4;
  uint32_t eq[DimsT::dk / 16][4];
#pragma unroll
  for (int kk = 0; kk < DimsT::dk / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + 8 * (i % 2), c = 16 * kk + 8 * (i / 2) + 2 * t;
      const float2 x = wg_pair(m.q, r, c);
      eq[kk][i] = pack2<__nv_bfloat16>(wg_eq(m.rn, p.scale, s, r, x.x), wg_eq(m.rn, p.scale, s, r, x.y));
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // v_new and h
  wgmma::fence_shared();
  __syncthreads();  // and everyone's; every read of q's rows (above) is done
  // o = P_hi v_new + P_lo v_new + (E Q) h: h [128, 128] MN-major (its 64-column blocks 128 rows of 128
  // bytes apart).
  float o[DimsT::dv / 2] = {};
  const uint64_t h_desc = wgmma::desc128(wgmma::saddr(h), DimsT::dk * 128, 1024);
  wgmma::fence_operand(o);
  wgmma::fence();
  wg_planes_times(o, ph, pl, v_new);
#pragma unroll
  for (int kk = 0; kk < DimsT::dk / 16; ++kk)
    wgmma::mma_rs<__nv_bfloat16, 1, DimsT::dv>(o, eq[kk], wgmma::desc_add(h_desc, kk * 2048));
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operand(o);
  // o staged as token rows over q's and k's bytes (no product reads them now), then 16 bytes a copy.
  auto* staged = reinterpret_cast<__nv_bfloat16*>(m.q);
  wg_stage(staged, o);
  __syncthreads();
  auto* out = static_cast<__nv_bfloat16*>(p.o);
#pragma unroll
  for (int u = 0; u < kRows / 8; ++u) {
    const int r = wg_row() + 8 * u;
    const int64_t tok = s.slot[r];
    if (tok < p.T)
      *reinterpret_cast<uint4*>(out + (tok * p.hv + b.h) * DimsT::dv + wg_col()) =
          *reinterpret_cast<const uint4*>(staged + r * kWgPitch + wg_col());
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// ---- Backward --------------------------------------------------------------------------------------

struct LocalSmem {
  Info* info;
  float *QP, *X;  // QP [64, 64 + pk + 8]; X: the keys [64, pk + 4], then d_o [64, pv + 8]
  int ldqp, ldo;
  template <typename DimsT>
  __host__ __device__ LocalSmem(Carve& c, const DimsT& d) : ldqp(kRows + d.pk + 8), ldo(d.pv + 8) {
    info = c.take<Info>(1);
    QP = c.take<float>(kRows * ldqp);
    X = c.take<float>(kRows * larger(d.pk + 4, ldo));
  }
};

// [dv_local; dh_local] = [P | E Q]^T d_o: v_new's gradient from inside the chunk and the state's
// from this chunk's outputs.
template <typename T, Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kThreads) local_grads_kernel(Args p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkBlock<LocalSmem, DimsT> b(p, smem);
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t head = b.head;
  const int h = b.h;
  build_qp<T, kMode, DimsT>(m.QP, m.ldqp, m.X, s, p, d, h);
  load_rows(m.X, m.ldo, static_cast<const T*>(p.d_o), p.hv, h, d.dv, d.pv, nullptr, s, p.T);
  __syncthreads();
  block_gemm<4, true, false, kMode, Tri::kUpperA>(m.QP, m.ldqp, m.X, m.ldo, kRows + d.dk, d.dv, kRows,
                                                   [&](int r, int c, float v) {
                                                     if (r < kRows) static_cast<float*>(p.dv_local)[(head * kRows + r) * d.dv + c] = v;
                                                     else p.dh_local[(head * d.dk + r - kRows) * d.dv + c] = v;
                                                   });
}

// local_grads_kernel on planes (kPlanes): dv_local = P^T d_o with P split in place once it is built,
// d_o's bfloat16 values exact in hi (two products for three); dh_local is left to the reverse
// recurrence (recurrence_planes_kernel<DimsT, true>), which forms each chunk's (E Q)^T d_o from E Q's
// hi plane (E Q rounded, the one product it was here) written to p.eq: a quarter of float32
// dh_local's bytes, and this kernel's product a third of what it was (H100, 8,192 tokens: 0.385 ->
// 0.264 ms, the reverse recurrence 0.338 -> 0.394). q's, k's and d_o's raw rows are copied before
// load_info (ChunkBlock's early; their slots read from global memory): issued after it, a block's
// dependent loads were four round trips in a row (slots, g and beta, q and k, then d_o after the
// Q K^T product), at two blocks a multiprocessor (0.780 ms at 32K tokens against fla's 0.351). So
// d_o has its own rows (hi alone: the product does not read lo), 105.7 KB a block, still two.
struct LocalPlanesSmem {
  Info* info;
  float *QP, *X, *rn;  // QP [64, 200]; X: q's, k's and d_o's raw rows [3][64, kPlaneRow] bfloat16 (d_o's at
                       // kDo); rn: q's and k's rsqrt norms [2][64]
  static constexpr int kDo = 2 * kRows * kPlaneRow;  // bfloat16 elements
  int ldqp;
  template <typename DimsT>
  __host__ __device__ LocalPlanesSmem(Carve& c, const DimsT& d) : ldqp(kRows + d.pk + 8) {
    info = c.take<Info>(1);
    QP = c.take<float>(kRows * ldqp);
    X = c.take<float>(3 * kRows * kPlaneRow / 2);
    rn = c.take<float>(2 * kRows);
  }
};

template <typename DimsT>
__global__ void __launch_bounds__(kThreads, 2) local_grads_planes_kernel(Args p) {  // two blocks a multiprocessor
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  extern __shared__ __align__(16) unsigned char smem[];
  using Smem = LocalPlanesSmem;
  const ChunkBlock<Smem, DimsT> b(p, smem, [&](const Smem& m, int64_t) {
    const int h = blockIdx.y, kh = h / (p.hv / p.hk);
    const auto* q_in = static_cast<const __nv_bfloat16*>(p.q);
    auto* q = reinterpret_cast<__nv_bfloat16*>(m.X);
    load_rows_early<true>(p.slots + static_cast<int64_t>(blockIdx.x) * kRows, p.T, EarlyRows{q, q_in, p.hk, kh},
                          EarlyRows{q + kRows * kPlaneRow, static_cast<const __nv_bfloat16*>(p.k), p.hk, kh},
                          EarlyRows{q + Smem::kDo, static_cast<const __nv_bfloat16*>(p.d_o), p.hv, h});
  });
  const DimsT& d = b.d;
  const auto& m = b.m;
  const int64_t head = b.head;
  static_assert(kRows + DimsT::pk + 8 == 200 && DimsT::pv + 8 == kPlaneRow, "LocalPlanesSmem's pitches");
  // (its wait_copies() takes d_o's rows in too)
  const __nv_bfloat16* qp = build_qp_planes<DimsT, true>(m.QP, m.ldqp, m.X, m.rn, b.s, p, d, b.h);
  const auto* d_o = reinterpret_cast<const __nv_bfloat16*>(m.X) + Smem::kDo;
  __syncthreads();
  // E Q's hi plane (the site q S's backward, one product) out, 16 bytes a thread.
  const int r0 = threadIdx.x / (DimsT::dk / 8), c = threadIdx.x % (DimsT::dk / 8) * 8;
#pragma unroll
  for (int u = 0; u < kRows * DimsT::dk / 8 / kThreads; ++u) {
    const int r = r0 + u * (8 * kThreads / DimsT::dk);
    *reinterpret_cast<uint4*>(p.eq + (head * kRows + r) * d.dk + c) =
        *reinterpret_cast<const uint4*>(qp + r * m.ldqp + kRows + c);
  }
  plane_gemm<4, true, false, true, false, kNever, kNever, Tri::kUpperA>(  // (kBExact: d_o's lo not read)
      qp, m.ldqp, kRows * m.ldqp, d_o, kPlaneRow, 0, kRows, d.dv, kRows,
      [&](int r, int c, float v0, float v1) {  // bfloat16 (tools/delta_rule_split_check.py --stored dv_local)
        *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(p.dv_local) + (head * kRows + r) * d.dv + c) =
            pack2<__nv_bfloat16>(v0, v1);
      });
}

// local_grads_planes_kernel on warpgroup products (the variant `local_wgmma`, on by default): dv_local = P^T
// d_o and E Q rounded (the reverse recurrence's, p.eq) for one chunk and head. At 32K tokens
// local_grads_planes took 0.654 ms against fla's chunk_bwd_dv_local 0.360 (H100, thirty-sixth session),
// latency-bound (51% of the issue slots busy). K Q^T is one m64n64 product (k as A: its accumulator is P^T,
// key rows c, query columns r), scaled as the output's P; P^T's hi and lo planes as A registers times d_o
// (MN-major, token rows by slot): exact, as local_grads_planes' two products. q, k and d_o by cp.async from
// the block's start: 51 KB, four blocks a multiprocessor (122 registers).
template <typename DimsT>
__global__ void __launch_bounds__(kWgThreads, 4) local_wgmma_kernel(Args p) {
#if defined(V4_HAS_WGMMA)
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  extern __shared__ __align__(16) unsigned char smem[];
  // The copies in two groups: q and k, d_o (its rows by slot).
  const auto rows_of_d_o = [&](const WgLocalSmem& m, int64_t) {
    wg_rows_by_slot(m.extra, static_cast<const __nv_bfloat16*>(p.d_o), p.hv, blockIdx.y, p);
    commit_copies();
  };
  const WgChunkBlock<1, DimsT, decltype(rows_of_d_o)> b(p, smem, rows_of_d_o);
  const auto& m = b.m;
  const Info& s = b.s;
  const unsigned char* d_o = m.extra;
  float kq[kRows / 2] = {};
  wg_gram_after_copies<1>(kq, m.k, m.q, m.rn, m.q, m.k);  // K Q^T from the raw rows: P^T's dots
  uint32_t th[kRows / 16][4], tl[kRows / 16][4];  // P^T's planes: key c, query r
  wg_planes(th, tl, kq, [&](int c, int r, float x) { return wg_p(m.rn, p.scale, s, r, c, x); });
  // E Q rounded to bfloat16 out, from q's rows.
  wg_map_rows(p.eq + b.head * kRows * DimsT::dk, m.q, [&](int r, float x) { return wg_eq(m.rn, p.scale, s, r, x); });
  asm volatile("cp.async.wait_group 0;\n" ::);  // d_o
  wgmma::fence_shared();
  __syncthreads();  // and everyone's; every read of q's rows (above) is done
  // dv_local = P^T_hi d_o + P^T_lo d_o.
  float dv[DimsT::dv / 2] = {};
  wg_planes_times_waited(dv, th, tl, d_o);
  // dv_local in bfloat16 (tools/delta_rule_split_check.py --stored dv_local), staged over q's and k's
  // bytes, then 16 bytes a copy into the chunk's rows.
  wg_write(static_cast<__nv_bfloat16*>(p.dv_local) + b.head * kRows * DimsT::dv, dv,
           reinterpret_cast<__nv_bfloat16*>(m.q));
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

struct StateSmem {
  Info* info;
  float *Y, *H, *D, *scratch;  // Y [128, pv + 4]: d_o and dv_new, then v_new; H: h and D: d_state [pk, pv + 4]
  int ld;
  template <typename DimsT>
  __host__ __device__ StateSmem(Carve& c, const DimsT& d) : ld(d.pv + 4) {
    info = c.take<Info>(1);
    Y = c.take<float>(2 * kRows * ld);
    H = c.take<float>(d.pk * ld);
    D = c.take<float>(d.pk * ld);
    scratch = c.take<float>(kWarps);
  }
};

// The products with the state h and the state's gradient after the chunk (d_state):
// dq_state = E (d_o h^T), dw = -(dv_new h^T), dk_tilde = v_new d_state^T, dgamma = <h, d_state>.
template <typename T, Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kThreads) state_grads_kernel(Args p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkBlock<StateSmem, DimsT> b(p, smem);
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t head = b.head;
  const int h = b.h;
  load_block(m.Y + kRows * m.ld, m.ld, static_cast<const float*>(p.dv_new) + head * kRows * d.dv, d.dv, kRows, d.dv,
             kRows, d.pv);
  load_block(m.H, m.ld, static_cast<const float*>(p.h) + head * d.dk * d.dv, d.dv, d.dk, d.dv, d.pk, d.pv);
  load_block(m.D, m.ld, static_cast<const float*>(p.d_state) + head * d.dk * d.dv, d.dv, d.dk, d.dv, d.pk, d.pv);
  load_rows(m.Y, m.ld, static_cast<const T*>(p.d_o), p.hv, h, d.dv, d.pv, nullptr, s, p.T);
  wait_copies();
  __syncthreads();
  block_gemm<4, false, true, kMode>(m.Y, m.ld, m.H, m.ld, 2 * kRows, d.dk, d.dv, [&](int r, int c, float v) {
    if (r < kRows) p.dq_state[(head * kRows + r) * d.dk + c] = s.E[r] * v;
    else p.dw[(head * kRows + r - kRows) * d.dk + c] = -v;
  });
  float dot = 0.0f;
  for (int idx = threadIdx.x; idx < d.pk * d.pv; idx += kThreads) {
    const int at = idx / d.pv * m.ld + idx % d.pv;
    dot += m.H[at] * m.D[at];
  }
  dot = block_sum(dot, m.scratch);  // (synchronises: Y is free)
  if (threadIdx.x == 0) p.dgamma[head] = dot;
  load_block(m.Y, m.ld, static_cast<const float*>(p.v_new) + head * kRows * d.dv, d.dv, kRows, d.dv, kRows, d.pv);
  wait_copies();
  __syncthreads();
  block_gemm<4, false, true, kMode>(m.Y, m.ld, m.D, m.ld, kRows, d.dk, d.dv, [&](int r, int c, float v) {
    p.dk_tilde[(head * kRows + r) * d.dk + c] = v;
  });
}

// This thread's share of dgamma = <h, d_state> (block_sum adds them): their bfloat16 values
// ([dk, dv] at pitch kPlaneRow) in float32.
template <typename DimsT>
__device__ __forceinline__ float state_dot(const __nv_bfloat16* H, const __nv_bfloat16* D) {
  float dot = 0.0f;
  const int at0 = threadIdx.x / (DimsT::dv / 2) * kPlaneRow + threadIdx.x % (DimsT::dv / 2) * 2;
#pragma unroll
  for (int u = 0; u < DimsT::dk * DimsT::dv / 2 / kThreads; ++u) {
    const int at = at0 + u * (2 * kThreads / DimsT::dv) * kPlaneRow;
    const float2 x = unpack2<__nv_bfloat16>(*reinterpret_cast<const uint32_t*>(H + at));
    const float2 y = unpack2<__nv_bfloat16>(*reinterpret_cast<const uint32_t*>(D + at));
    dot += x.x * y.x + x.y * y.y;
  }
  return dot;
}

struct IntraSmem {
  Info* info;
  double *dG, *t;
  float *rq, *Q, *K, *D, *V, *Z, *dPL;  // Q, K [64, pk + 4]; D, V [64, max + 4]; Z, dPL [64, 68]
  int ldq, ldd;
  template <typename DimsT>
  __host__ __device__ IntraSmem(Carve& c, const DimsT& d) : ldq(d.pk + 4), ldd(larger(d.pk, d.pv) + 4) {
    info = c.take<Info>(1);
    dG = c.take<double>(kRows);
    t = c.take<double>(kRows);
    rq = c.take<float>(kRows);
    Q = c.take<float>(kRows * ldq);
    K = c.take<float>(kRows * ldq);
    D = c.take<float>(kRows * ldd);
    V = c.take<float>(kRows * ldd);
    Z = c.take<float>(kRows * kPitch64);
    dPL = c.take<float>(kRows * kPitch64);
  }
};

// Inside the chunk: dP = d_o v_new^T; q's gradient (dq_state + (dP L) K, through the norm), k's part
// (dP L)^T Q + exp(G_63 - G) dk_tilde, and G's parts (from L, E and Kt; gamma's at slot 63).
// D holds d_o, then dq_state and q's gradient; V v_new, then dk_tilde and k's part.
template <typename T, Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kThreads) intra_grads_kernel(Args p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkBlock<IntraSmem, DimsT> b(p, smem);
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t head = b.head, rows = b.rows;
  const int h = b.h, kh = b.kh, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  load_block(m.V, m.ldd, static_cast<const float*>(p.v_new) + rows * d.dv, d.dv, kRows, d.dv, kRows, d.pv);
  load_normalised(m.Q, m.ldq, m.rq, static_cast<const T*>(p.q), p.hk, kh, d.dk, d.pk, p.scale, s, p.T);
  load_normalised(m.K, m.ldq, nullptr, static_cast<const T*>(p.k), p.hk, kh, d.dk, d.pk, 1.0f, s, p.T);
  load_rows(m.D, m.ldd, static_cast<const T*>(p.d_o), p.hv, h, d.dv, d.pv, nullptr, s, p.T);
  wait_copies();
  __syncthreads();
  block_gemm<2, false, true, kMode>(m.Q, m.ldq, m.K, m.ldq, kRows, kRows, d.dk, [&](int r, int c, float v) {
    m.Z[r * kPitch64 + c] = v;
  });
  __syncthreads();
  // dPL = (d_o v_new^T) * L; Z = dPL * (Q K^T), G's gradient through L: dG_i = sum_j Z_ij - Z_ji.
  block_gemm<2, false, true, kMode, Tri::kLowerC>(m.D, m.ldd, m.V, m.ldd, kRows, kRows, d.dv,
                                                  [&](int r, int c, float v) {
                                                    const float dpl = c <= r ? v * decay(s, r, c) : 0.0f;
                                                    m.dPL[r * kPitch64 + c] = dpl;
                                                    m.Z[r * kPitch64 + c] *= dpl;
                                                  });
  __syncthreads();
  load_block(m.D, m.ldd, p.dq_state + rows * d.dk, d.dk, kRows, d.dk, kRows, d.pk);
  load_block(m.V, m.ldd, p.dk_tilde + rows * d.dk, d.dk, kRows, d.dk, kRows, d.pk);
  if (const double z = antisymmetric_row_sum(m.Z); tid % kRowThreads == 0) m.dG[tid / kRowThreads] = z;
  wait_copies();
  __syncthreads();
  // G's gradient through E (Q . dq_state) and Kt (Kt K . dk_tilde; the sum of those to slot 63).
  for (int i = warp; i < kRows; i += kWarps) {
    float e = 0.0f, kt = 0.0f;
    for (int c = lane; c < d.dk; c += 32) {
      e += m.Q[i * m.ldq + c] * m.D[i * m.ldd + c];
      kt += m.K[i * m.ldq + c] * m.V[i * m.ldd + c];
    }
    e = warp_sum(e);
    kt = s.Kt[i] * warp_sum(kt);
    if (lane == 0) {
      m.dG[i] += static_cast<double>(e) - kt;
      m.t[i] = kt;
    }
  }
  __syncthreads();
  block_gemm<2, false, false, kMode, Tri::kLowerA>(m.dPL, kPitch64, m.K, m.ldq, kRows, d.dk, kRows,
                                                   [&](int r, int c, float v) { m.D[r * m.ldd + c] += v; });
  block_gemm<2, true, false, kMode, Tri::kUpperA>(m.dPL, kPitch64, m.Q, m.ldq, kRows, d.dk, kRows,
                                                  [&](int r, int c, float v) {
                                                    m.V[r * m.ldd + c] = v + s.Kt[r] * m.V[r * m.ldd + c];
                                                  });
  __syncthreads();
  for (int i = warp; i < kRows; i += kWarps) {
    for (int c = lane; c < d.dk; c += 32) p.dk_part[(rows + i) * d.dk + c] = m.V[i * m.ldd + c];
    const int64_t tok = s.slot[i];
    if (tok < p.T) {
      const float* q = m.Q + i * m.ldq;
      normalised_backward(p.dq + (tok * p.hv + h) * d.dk, [&](int c) { return q[c]; }, m.rq[i], m.D + i * m.ldd, d.dk,
                          p.scale);
    }
  }
  if (tid < kRows) {
    double v = m.dG[tid];
    if (tid == kRows - 1) {
      for (int j = 0; j < kRows; ++j) v += m.t[j];
      v += static_cast<double>(p.dgamma[head]) * s.gamma;
    }
    p.dg_part[rows + tid] = v;
  }
}

// Steps of intra_grads on planes (dqkwg_planes_kernel).
//
// dPL [64, kPitch64] (float32) as the planes of its two scalings ([64, kPlane64], lo at + kRows kPlane64):
// pk = dPL diag(r_k), for q's gradient, and pq = diag(r_q s) dPL, for k's.
__device__ __forceinline__ void split_dpl(__nv_bfloat16* pk, __nv_bfloat16* pq, const float* dpl, const float* rq,
                                          const float* rk, float scale) {
  constexpr int kLo64 = kRows * kPlane64;
  const int r0 = threadIdx.x / (kRows / 2), c = threadIdx.x % (kRows / 2) * 2;
#pragma unroll
  for (int u = 0; u < kRows * kRows / 2 / kThreads; ++u) {
    const int r = r0 + u * (2 * kThreads / kRows);
    const float2 x = *reinterpret_cast<const float2*>(dpl + r * kPitch64 + c);  // (one load: conflict free)
    const float sq = rq[r] * scale;
    store_split2(pk + r * kPlane64 + c, kLo64, x.x * rk[c], x.y * rk[c + 1]);
    store_split2(pq + r * kPlane64 + c, kLo64, x.x * sq, x.y * sq);
  }
}

// G's gradient through E (Q . dq_state) and Kt (Kt K . dk_tilde; the sum of those to slot 63), with Q
// and K as load_normalised makes them (q, k: raw rows; dq_state, dk_tilde [64, ld]), a warp a row:
// dG[i] = e - kt, t[i] = kt. Unrolled, a warp's four rows have their loads in flight at once (rolled,
// each row waited on its own: 16% of the stall samples of intra_grads on planes, ncu 2026-12-06).
template <int kDk>
__device__ __forceinline__ void e_kt_terms(double* dG, double* t, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                           const float* rq, const float* rk, float scale, const float* dq_state,
                                           const float* dk_tilde, int ld, const Info& s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kRows / kWarps; ++j) {
    const int i = warp + j * kWarps;
    float e = 0.0f, kt = 0.0f;
#pragma unroll
    for (int u = 0; u < kDk / 32; ++u) {
      const int c = lane + 32 * u;
      e += __bfloat162float(q[i * kPlaneRow + c]) * rq[i] * scale * dq_state[i * ld + c];
      kt += __bfloat162float(k[i * kPlaneRow + c]) * rk[i] * dk_tilde[i * ld + c];
    }
    e = warp_sum(e);
    kt = s.Kt[i] * warp_sum(kt);
    if (lane == 0) {
      dG[i] = static_cast<double>(e) - kt;
      t[i] = kt;
    }
  }
}

// The end of intra_grads on planes: q's gradient through its norm from dq [64, ld] (q: raw rows) into
// p.dq, and G's [64] into p.dg_part (dG, and at slot 63 the sum of t and dgamma gamma).
template <int kDk>
__device__ __forceinline__ void q_grad_and_g(const Args& p, const Info& s, const __nv_bfloat16* q_rows, const float* rq,
                                             float* dq, int ld, const double* dG, const double* t, int64_t rows,
                                             float dgamma) {
  const int tid = threadIdx.x, warp = tid / 32;
  for (int i = warp; i < kRows; i += kWarps) {
    const int64_t tok = s.slot[i];
    if (tok < p.T) {
      const __nv_bfloat16* q = q_rows + i * kPlaneRow;
      const float r = rq[i];
      // (in place: a lane writes the columns it read)
      normalised_backward(dq + i * ld, [&](int c) { return __bfloat162float(q[c]) * r * p.scale; }, r, dq + i * ld,
                          kDk, p.scale);
    }
  }
  if (tid < kRows) {
    double v = dG[tid];
    if (tid == kRows - 1) {
      for (int j = 0; j < kRows; ++j) v += t[j];
      v += static_cast<double>(dgamma) * s.gamma;
    }
    p.dg_part[rows + tid] = v;
  }
}

// state_grads and intra_grads on planes in one kernel (the work of fla's chunk_bwd_dqkwg): dq_state,
// dk_tilde and dPL stay in shared memory, and q, k, d_o, v_new, dv_new, h and d_state are read once.
// It replaced three kernels (state_grads_planes, intra_dpl, intra_grads_planes: 0.914 ms at 8K on an
// H100, this one 0.707, the same bits; docs/benchmarks.md, twenty-seventh session), which wrote the
// first three as float32 tiles and read them back, and read q, k, d_o and v_new twice. Each product
// keeps those kernels' roundings (one bf16 product at state_grads' sites, planes elsewhere). One block a
// multiprocessor: a chunk's operands whole (q, k, d_o, v_new's planes, dv_new, h, d_state: 170 KB as
// loaded) and its two float32 tiles (dq_state, dk_tilde) take 224 KB, regions reused as below. Two
// blocks (113 KB each) would take the products over dv in slices with register accumulators, not
// plane_gemm's whole-K tiles, or dk split over a cluster of two with the operands indexed by dv
// (d_o, v_new, dv_new: 68 KB) still whole in each.
//
// The phases (a barrier after each): 1 the loads (h, d_state, v_new and dv_new before Info: waited
// for first; v_new's bfloat16 rows, exact, in v's hi plane alone); 2 dgamma = <h, d_state>,
// dw = -(dv_new h^T); 3 (q's, k's and d_o's rows in) the norms of q's and k's rows, dq_state = E (d_o h^T),
// dPL = (d_o v_new^T) * L (both exact: one product); 4 dk_tilde = v_new d_state^T into the bytes
// of v's lo plane and h, dPL's two scaled plane sets after it (over h and Y); 5 Z = dPL * (Q K^T) in
// place, G's terms through E and Kt; 6 G's through L, q's gradient dq_state + (dPL diag(r_k)) k, k's
// part (diag(r_q s) dPL)^T q + Kt dk_tilde; 7 q's gradient through its norm, G's into dg_part.
struct DqkwgSmem {
  static constexpr int kLdF = 128 + 8;  // dq_state's and dk_tilde's pitch (floats): an epilogue's pairs conflict free
  // R's parts (bfloat16 elements): v [2][64, kPlaneRow], h and Y [128, kPlaneRow] each; from phase 4
  // dk_tilde after v's hi plane, then pk and pq [2][64, kPlane64].
  static constexpr int kPlaneTile = kRows * kPlaneRow, kR = 6 * kPlaneTile, kDkt = kPlaneTile,  // (elements)
                       kPk = kDkt + 2 * kRows * kLdF, kPq = kPk + 2 * kRows * kPlane64;
  static_assert(kPq + 2 * kRows * kPlane64 <= kR, "dk_tilde, pk and pq within R");
  Info* info;
  double *dG, *t;
  float *rq, *rk, *scratch;
  __nv_bfloat16 *q, *k, *S;  // raw rows [64, kPlaneRow]; d_state [128, kPlaneRow]
  float *DQ, *Z;  // DQ [64, kLdF]: dq_state, then q's gradient; Z [64, kPitch64]: dPL, then Z
  __nv_bfloat16 *v, *H, *Y, *pk, *pq;  // R's parts; Y: d_o's raw rows, dv_new's (bfloat16) below them
  float* DKT;                          // dk_tilde [64, kLdF]
  template <typename DimsT>
  __host__ __device__ DqkwgSmem(Carve& c, const DimsT&) {
    info = c.take<Info>(1);
    dG = c.take<double>(kRows);
    t = c.take<double>(kRows);
    rq = c.take<float>(kRows);
    rk = c.take<float>(kRows);
    scratch = c.take<float>(kWarps);
    q = c.take<__nv_bfloat16>(kPlaneTile);
    k = c.take<__nv_bfloat16>(kPlaneTile);
    S = c.take<__nv_bfloat16>(2 * kPlaneTile);
    DQ = c.take<float>(kRows * kLdF);
    Z = c.take<float>(kRows * kPitch64);
    v = c.take<__nv_bfloat16>(kR);
    H = v + 2 * kPlaneTile;
    Y = v + 4 * kPlaneTile;
    DKT = reinterpret_cast<float*>(v + kDkt);
    pk = v + kPk;
    pq = v + kPq;
  }
};

template <typename DimsT>
__global__ void __launch_bounds__(kThreads, 1) dqkwg_planes_kernel(Args p) {  // one block a multiprocessor
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kState = DimsT::dk * DimsT::dv, kLdF = DqkwgSmem::kLdF, kLo64 = kRows * kPlane64;
  // Before Info: h, d_state, v_new's bfloat16 rows into v's hi plane and dv_new's into Y's second half
  // (every global load an asynchronous copy: a load from global memory waits a round trip). dgamma
  // and dw take place while q's, k's and d_o's rows (which need Info) are in flight.
  const ChunkBlock<DqkwgSmem, DimsT> b(p, smem, [&](const DqkwgSmem& m, int64_t head) {
    copy_rows<128>(m.H, kPlaneRow, static_cast<const __nv_bfloat16*>(p.h) + kState * head, DimsT::dv, DimsT::dk);
    copy_rows<128>(m.S, kPlaneRow, static_cast<const __nv_bfloat16*>(p.d_state) + kState * head, DimsT::dv, DimsT::dk);
    copy_rows<DimsT::dv>(m.v, kPlaneRow, static_cast<const __nv_bfloat16*>(p.v_new) + head * kRows * DimsT::dv,
                         DimsT::dv, kRows);
    copy_rows<DimsT::dv>(m.Y + kRows * kPlaneRow, kPlaneRow,
                         static_cast<const __nv_bfloat16*>(p.dv_new) + head * kRows * DimsT::dv, DimsT::dv, kRows);
    commit_copies();
  });
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t rows = b.rows;
  load_rows_split(m.q, -1, static_cast<const __nv_bfloat16*>(p.q), p.hk, b.kh, s, p.T);
  load_rows_split(m.k, -1, static_cast<const __nv_bfloat16*>(p.k), p.hk, b.kh, s, p.T);
  load_rows_split(m.Y, -1, static_cast<const __nv_bfloat16*>(p.d_o), p.hv, b.h, s, p.T);
  wait_copies_before();
  __syncthreads();
  const float dgamma = block_sum(state_dot<DimsT>(m.H, m.S), m.scratch);  // (synchronises)
  // dv_new h^T then d_o h^T, each operand bfloat16 (d_o exact, dv_new and h stored so): one product
  // each, as state_grads'. dw in bfloat16, as W lay in these bytes (the first half of each chunk's
  // floats), which wy_grads takes exact: tools/delta_rule_split_check.py --stored dw prices it at
  // nothing measurable (g's gradient on the long documents 2.59-2.66e-3 from its plain-products
  // variant, against 2.55-2.63e-3 with dw in float32).
  auto* dw = reinterpret_cast<__nv_bfloat16*>(p.dw + rows * DimsT::dk);
  plane_gemm<4, false, true, true, true>(m.Y + kRows * kPlaneRow, kPlaneRow, 0, m.H, kPlaneRow, 0, kRows, DimsT::dk,
                                         DimsT::dv, [&](int r, int c, float v0, float v1) {
                                           *reinterpret_cast<uint32_t*>(dw + r * DimsT::dk + c) =
                                               pack2<__nv_bfloat16>(-v0, -v1);
                                         });
  wait_copies();
  __syncthreads();
  row_rnorms(m.rq, m.q, kPlaneRow);
  row_rnorms(m.rk, m.k, kPlaneRow);
  plane_gemm<4, false, true, true, true>(m.Y, kPlaneRow, 0, m.H, kPlaneRow, 0, kRows, DimsT::dk, DimsT::dv,
                                         [&](int r, int c, float v0, float v1) {
                                           store2(m.DQ + r * kLdF + c, s.E[r] * v0, s.E[r] * v1);
                                         });
  // d_o v_new^T, both exact (v_new stored in bfloat16): one product.
  plane_gemm<2, false, true, true, true, kNever, kNever, Tri::kLowerC>(
      m.Y, kPlaneRow, 0, m.v, kPlaneRow, kRows * kPlaneRow, kRows, kRows, DimsT::dv,
      [&](int r, int c, float v0, float v1) {
        store2(m.Z + r * kPitch64 + c, c <= r ? v0 * decay(s, r, c) : 0.0f, c + 1 <= r ? v1 * decay(s, r, c + 1) : 0.0f);
      });
  __syncthreads();  // h, Y and v's lo plane are free
  // v_new d_state^T, d_state rounded once: one product, as state_grads.
  plane_gemm<4, false, true, true, true>(m.v, kPlaneRow, 0, m.S, kPlaneRow, 0, kRows, DimsT::dk, DimsT::dv,
                                         [&](int r, int c, float v0, float v1) { store2(m.DKT + r * kLdF + c, v0, v1); });
  split_dpl(m.pk, m.pq, m.Z, m.rq, m.rk, p.scale);
  __syncthreads();
  // q k^T of the raw rows (exact): one product, the norms and the scale after it.
  plane_gemm<2, false, true, true, true>(m.q, kPlaneRow, 0, m.k, kPlaneRow, 0, kRows, kRows, DimsT::dk,
                                         [&](int r, int c, float v0, float v1) {
                                           float2* z = reinterpret_cast<float2*>(m.Z + r * kPitch64 + c);
                                           const float2 zz = *z;
                                           *z = make_float2(zz.x * (v0 * m.rq[r] * p.scale * m.rk[c]),
                                                            zz.y * (v1 * m.rq[r] * p.scale * m.rk[c + 1]));
                                         });
  e_kt_terms<DimsT::dk>(m.dG, m.t, m.q, m.k, m.rq, m.rk, p.scale, m.DQ, m.DKT, kLdF, s);
  __syncthreads();
  if (const double z = antisymmetric_row_sum(m.Z); threadIdx.x % kRowThreads == 0) {
    m.dG[threadIdx.x / kRowThreads] = z + m.dG[threadIdx.x / kRowThreads];  // (L's term first, the order the three kernels summed in)
  }
  // dPL's scaled planes against the raw rows (k, then q): two products each, as intra_grads.
  plane_gemm<4, false, false, true, false, kNever, kNever, Tri::kLowerA>(
      m.pk, kPlane64, kLo64, m.k, kPlaneRow, 0, kRows, DimsT::dk, kRows, [&](int r, int c, float v0, float v1) {
        float2* dq = reinterpret_cast<float2*>(m.DQ + r * kLdF + c);  // (pairs: conflict free at kLdF)
        const float2 x = *dq;
        *dq = make_float2(x.x + v0, x.y + v1);
      });
  plane_gemm<4, true, false, true, false, kNever, kNever, Tri::kUpperA>(
      m.pq, kPlane64, kLo64, m.q, kPlaneRow, 0, kRows, DimsT::dk, kRows, [&](int r, int c, float v0, float v1) {
        const float2 kt = *reinterpret_cast<const float2*>(m.DKT + r * kLdF + c);
        store2(p.dk_part + (rows + r) * DimsT::dk + c, v0 + s.Kt[r] * kt.x, v1 + s.Kt[r] * kt.y);
      });
  __syncthreads();
  q_grad_and_g<DimsT::dk>(p, s, m.q, m.rq, m.DQ, kLdF, m.dG, m.t, rows, dgamma);
  sum_over_value_heads(m.DQ, kLdF, p.dq_keys, s, p, b.kh);
}

struct WySmem {
  Info* info;
  double* dG;
  float *rk, *K, *X, *R, *A, *Ai, *KKL;  // K [64, pk + 4]; X, R [64, pv + pk + 4] (R at least [64, 68]);
  int ldk, ldx;                          // A, Ai, KKL [64, 68]
  template <typename DimsT>
  __host__ __device__ WySmem(Carve& c, const DimsT& d) : ldk(d.pk + 4), ldx(d.pv + d.pk + 4) {
    info = c.take<Info>(1);
    dG = c.take<double>(kRows);
    rk = c.take<float>(kRows);
    K = c.take<float>(kRows * ldk);
    X = c.take<float>(kRows * ldx);
    R = c.take<float>(kRows * larger(ldx, kPitch64));
    A = c.take<float>(kRows * kPitch64);
    Ai = c.take<float>(kRows * kPitch64);
    KKL = c.take<float>(kRows * kPitch64);
  }
};

// The UT transform's backward, with Ai = (I + A)^-1 and the forward's X = Ai R: dR = Ai^T [dv_new |
// dw]; dM = -dR X^T = -Ai^T ([dv_new | dw] R^T) Ai^T (strictly lower), so X is never formed (Ai and
// L * K K^T from prepare's recomputation, which has the threads idle for them); then
// v's, beta's, k's (with k_part, through the norm) and g's gradients (with dg_part, summed from each
// slot to the chunk's end). R holds [dv_new | dw], then Ai^T Y, then [V | k_part], then [V | k's
// gradient]; X holds R = [beta V | beta E K], then dR. A holds Y, then dM.
template <typename T, Mode kMode, typename DimsT>
__global__ void __launch_bounds__(kThreads) wy_grads_kernel(Args p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkBlock<WySmem, DimsT> b(p, smem);
  const DimsT& d = b.d;
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t rows = b.rows;
  const int h = b.h, kh = b.kh, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* v = static_cast<const T*>(p.v);
  static_assert(!kPlanes<kMode, DimsT>, "on planes, wy_grads_planes_kernel");
  T* dv = static_cast<T*>(p.dv_out);
  // Ai and L * K K^T as prepare's recomputation wrote them.
  load_block(m.Ai, kPitch64, p.ai + rows * kRows, kRows, kRows, kRows, kRows, kRows);
  load_block(m.KKL, kPitch64, p.kkl + rows * kRows, kRows, kRows, kRows, kRows, kRows);
  load_block(m.R, m.ldx, static_cast<const float*>(p.dv_new) + rows * d.dv, d.dv, kRows, d.dv, kRows, d.pv);
  load_block(m.R + d.pv, m.ldx, p.dw + rows * d.dk, d.dk, kRows, d.dk, kRows, d.pk);
  load_normalised(m.K, m.ldk, m.rk, static_cast<const T*>(p.k), p.hk, kh, d.dk, d.pk, 1.0f, s, p.T);
  load_rows(m.X, m.ldx, v, p.hv, h, d.dv, d.pv, s.beta, s, p.T);
  __syncthreads();
  for (int idx = tid; idx < kRows * d.pk; idx += kThreads) {
    const int i = idx / d.pk, c = idx % d.pk;
    m.X[i * m.ldx + d.pv + c] = s.beta[i] * s.E[i] * m.K[i * m.ldk + c];
  }
  wait_copies();
  __syncthreads();
  // Y = [dv_new | dw] R^T into A.
  block_gemm<2, false, true, kMode>(m.R, m.ldx, m.X, m.ldx, kRows, kRows, d.pv + d.pk, [&](int r, int c, float val) {
    m.A[r * kPitch64 + c] = val;
  });
  __syncthreads();
  // dR = Ai^T [dv_new | dw] into X.
  block_gemm<4, true, false, kMode, Tri::kUpperA>(m.Ai, kPitch64, m.R, m.ldx, kRows, d.pv + d.pk, kRows,
                                                  [&](int r, int c, float val) { m.X[r * m.ldx + c] = val; });
  __syncthreads();
  // dM = -(Ai^T Y) Ai^T, strictly lower, into A (Ai^T Y through R, which is read).
  block_gemm<2, true, false, kMode, Tri::kUpperA>(m.Ai, kPitch64, m.A, kPitch64, kRows, kRows, kRows,
                                                  [&](int r, int c, float val) { m.R[r * kPitch64 + c] = val; });
  __syncthreads();
  block_gemm<2, false, true, kMode, Tri::kUpperB | Tri::kLowerC>(
      m.R, kPitch64, m.Ai, kPitch64, kRows, kRows, kRows,
      [&](int r, int c, float val) { m.A[r * kPitch64 + c] = c < r ? -val : 0.0f; });
  __syncthreads();
  load_rows(m.R, m.ldx, v, p.hv, h, d.dv, d.pv, nullptr, s, p.T);
  load_block(m.R + d.pv, m.ldx, p.dk_part + rows * d.dk, d.dk, kRows, d.dk, kRows, d.pk);
  wait_copies();
  __syncthreads();
  for (int i = warp; i < kRows; i += kWarps) {
    const int64_t tok = s.slot[i];
    float sv = 0.0f, sk = 0.0f, sa = 0.0f;
    for (int c = lane; c < d.dv; c += 32) {  // and v's gradient, beta dR_V
      const float dr = m.X[i * m.ldx + c];
      sv += m.R[i * m.ldx + c] * dr;
      if (tok < p.T) dv[(tok * p.hv + h) * d.dv + c] = from_float<T>(s.beta[i] * dr);
    }
    for (int c = lane; c < d.dk; c += 32) sk += m.K[i * m.ldk + c] * m.X[i * m.ldx + d.pv + c];
    for (int j = lane; j < kRows; j += 32) sa += m.KKL[i * kPitch64 + j] * m.A[i * kPitch64 + j];
    sv = warp_sum(sv);
    sk = warp_sum(sk);
    sa = warp_sum(sa);
    if (lane == 0) {
      if (tok < p.T) p.dbeta[tok * p.hv + h] = sv + s.E[i] * sk + sa;
      m.dG[i] = static_cast<double>(s.beta[i]) * s.E[i] * sk;
    }
    __syncwarp();
    // Z = beta KKL dM (G's gradient through L); C = beta L dM (k's through K K^T), strictly lower,
    // into Ai as C + C^T: row i writes C's (i, j) and (j, i) for j < i, so each entry once.
    for (int j = lane; j < kRows; j += 32) {
      const float dm = m.A[i * kPitch64 + j];
      m.KKL[i * kPitch64 + j] = s.beta[i] * m.KKL[i * kPitch64 + j] * dm;
      if (j <= i) {
        const float c = j < i ? s.beta[i] * decay(s, i, j) * dm : 0.0f;
        m.Ai[i * kPitch64 + j] = c;
        m.Ai[j * kPitch64 + i] = c;
      }
    }
  }
  __syncthreads();
  if (const double z = antisymmetric_row_sum(m.KKL); tid % kRowThreads == 0) {
    m.dG[tid / kRowThreads] += z + p.dg_part[rows + tid / kRowThreads];
  }
  // k's gradient: (C + C^T) K + beta E dR_K + k_part, in R's key columns.
  float* dk = m.R + d.pv;
  const auto dk_out = [&](int r, int c, float val) {
    dk[r * m.ldx + c] += val + s.beta[r] * s.E[r] * m.X[r * m.ldx + d.pv + c];
  };
  block_gemm<2, false, false, kMode>(m.Ai, kPitch64, m.K, m.ldk, kRows, d.dk, kRows, dk_out);
  __syncthreads();
  for (int i = warp; i < kRows; i += kWarps) {
    const int64_t tok = s.slot[i];
    if (tok < p.T) {
      const float* k = m.K + i * m.ldk;
      normalised_backward(p.dk_out + (tok * p.hv + h) * d.dk, [&](int c) { return k[c]; }, m.rk[i], dk + i * m.ldx, d.dk,
                          1.0f);
    }
  }
  scan64(m.dG, true);  // g_s's gradient: the sum of G_i's over i >= s
  __syncthreads();
  if (tid < kRows && s.slot[tid] < p.T) p.dg[s.slot[tid] * p.hv + h] = m.dG[tid];
}

// The sums over the warp's 32 lanes of V values at once (V a power of two up to 32): value v's in
// lanes v 32 / V .. (v + 1) 32 / V - 1, its additions warp_sum's (lane l's partial sum and lane l ^ 16's,
// then l ^ 8's, ...: the same bits), in V + 4 - log2 V shuffles for warp_sum's 5 V. Each of the first
// log2 V rounds keeps half the values (the upper half where the lane's bit o is set), the partner the
// other half.
template <int V>
__device__ __forceinline__ float warp_sums(float (&a)[V]) {
  static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "a power of two, at most a lane each");
  const int lane = threadIdx.x % 32;
  int o = 16;
#pragma unroll
  for (int n = V; n > 1; n /= 2, o /= 2) {
    const bool upper = lane & o;
#pragma unroll
    for (int k = 0; k < n / 2; ++k) {
      const float keep = upper ? a[k + n / 2] : a[k], give = upper ? a[k] : a[k + n / 2];
      a[k] = keep + __shfl_xor_sync(0xffffffffu, give, o);
    }
  }
  float x = a[0];
#pragma unroll
  for (; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// wy_grads_kernel on planes (kPlanes), at two blocks a multiprocessor where the float32 tiles took
// 222 KB and one: k's and v's raw rows (exact in bfloat16), Ai and 64 columns of [dv_new | dw] at a
// time as planes. Y = [dv_new | dw] [beta V | beta E K]^T as dv_new v^T and dw k^T, each column j
// then scaled (beta_j; beta_j E_j r_k,j); dR = Ai^T [dv_new | dw] a quarter at a time, the values'
// used up at once (beta dR_V, V . dR_V), the keys' kept; then Ai^T Y and dM as the float32 kernel
// takes them, on planes, and k's gradient (C + C^T) diag(r_k) k as one bf16 product (that site's).
struct WyPlanesSmem {
  // D's and dr's pitches 8 mod 32 words: the products' epilogues store a lane's pair of columns (8
  // bytes) in rows g, columns 2 t, so a half warp's four rows fall in distinct banks (4 mod 32, 132
  // and 68, were two-way conflicted: ncu26, 3% of the kernel's shared wavefronts in excess).
  static constexpr int kLdD = 128 + 8, kLdR = kRows + 8;
  Info* info;
  double* dG;
  float *rk, *sv, *Y, *D;  // Y [64, 68]: the quarters' values staged (Y itself in registers), then Ai^T Y,
                           // then dM. D [64, kLdD]: in the value quarters v's raw rows (its first bytes)
                           // and dR's quarter [64, kLdR] after them; then dR_K, then k's gradient
  __nv_bfloat16 *k, *v, *ai, *p;  // k [64, kPlaneRow]; v in D's bytes; ai, p: planes [2][64, kPlane64]:
                                  // Ai (then (C + C^T) diag(r_k)), a quarter of [dv_new | dw] (then Y, Ai^T Y, Z)
  float* dr;                      // the value quarters' dR [64, kLdR], in D's bytes after v
  template <typename DimsT>
  __host__ __device__ WyPlanesSmem(Carve& c, const DimsT&) {
    info = c.take<Info>(1);
    dG = c.take<double>(kRows);
    rk = c.take<float>(kRows);
    sv = c.take<float>(kRows);
    Y = c.take<float>(kRows * kPitch64);
    D = c.take<float>(larger(kRows * kLdD, kRows * kPlaneRow / 2 + kRows * kLdR));
    v = reinterpret_cast<__nv_bfloat16*>(D);
    dr = D + kRows * kPlaneRow / 2;
    k = c.take<__nv_bfloat16>(kRows * kPlaneRow);
    ai = c.take<__nv_bfloat16>(2 * kRows * kPlane64);
    p = c.take<__nv_bfloat16>(2 * kRows * kPlane64);
  }
};

template <typename DimsT>
__global__ void __launch_bounds__(kThreads, 2) wy_grads_planes_kernel(Args p) {  // two blocks a multiprocessor
  static_assert(DimsT::dk == 128 && DimsT::dv == 128, "Qwen3.5's widths");
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kLo64 = kRows * kPlane64, kLdD = WyPlanesSmem::kLdD, kLdR = WyPlanesSmem::kLdR;
  constexpr int kQ = 64;  // a quarter's columns
  // Before load_info (ChunkBlock's early): k's and v's raw rows, the first quarter's values, and Ai's
  // floats into registers (a thread's quads of rows tid / 16 and + 32, columns tid % 16 * 4, as
  // load_split takes them), split into planes after it. Issued after load_info, the block waited on
  // them at the first barrier (ncu27: SASS 531 and 572, 2,400 long-scoreboard samples, 4.3%).
  float4 ai_quads[2];
  const ChunkBlock<WyPlanesSmem, DimsT> b(p, smem, [&](const WyPlanesSmem& m, int64_t head) {
    copy_rows<kQ>(reinterpret_cast<__nv_bfloat16*>(m.Y), 2 * kPitch64,  // fetch(0) (below)
                  static_cast<const __nv_bfloat16*>(p.dv_new) + head * kRows * 128, 128, kRows);
    const int h = blockIdx.y;
    load_rows_early(p.slots + static_cast<int64_t>(blockIdx.x) * kRows, p.T,
                    EarlyRows{m.k, static_cast<const __nv_bfloat16*>(p.k), p.hk, h / (p.hv / p.hk)},
                    EarlyRows{m.v, static_cast<const __nv_bfloat16*>(p.v), p.hv, h});
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // (last: held across load_info, they spilled where loaded first)
      ai_quads[u] = *reinterpret_cast<const float4*>(p.ai + (head * kRows + threadIdx.x / 16 + 32 * u) * kRows +
                                                     threadIdx.x % 16 * 4);
    }
  });
  const auto& m = b.m;
  Info& s = b.s;
  const int64_t rows = b.rows;
  const int h = b.h, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  auto* dv = static_cast<__nv_bfloat16*>(p.dv_out);
  // The quarters' values (dv_new's and dw's, bfloat16) are copied a quarter ahead (cp.async) into
  // Y's bytes, free while the quarters run (Y is in y), and put into p from there after the
  // barrier: loaded after it, the whole block waited on memory there (ncu26: the quarters'
  // load_split, 13% of the stall samples).
  auto* const staged = reinterpret_cast<__nv_bfloat16*>(m.Y);  // [64, 2 kPitch64] bfloat16 values
  const auto fetch = [&](int q) {
    const auto* x = q >= 2 ? reinterpret_cast<const __nv_bfloat16*>(p.dw + rows * 128)  // (as dqkwg wrote it)
                           : static_cast<const __nv_bfloat16*>(p.dv_new) + rows * 128;
    copy_rows<kQ>(staged, 2 * kPitch64, x + q % 2 * kQ, 128, kRows);
  };
#pragma unroll
  for (int u = 0; u < 2; ++u) store_split4(m.ai + (tid / 16 + 32 * u) * kPlane64 + tid % 16 * 4, kLo64, ai_quads[u]);
  if (tid < kRows) m.sv[tid] = 0.0f;
  wait_copies();
  __syncthreads();
  row_rnorms(m.rk, m.k, kPlaneRow);
  // Y's product deals one 16 x 16 tile a warp (tile = warp): the warp keeps its tile in y across the
  // quarters, y[j * 4 + e] the element plane_gemm hands from acc[j][e] (rows m0 + g, + 8; columns
  // n0 + 8 j + 2 t, + 1). Each quarter's read, add and write back of Y in shared memory, one
  // element a lane and two-way bank conflicted, with s.beta, s.E and m.rk read again for each element
  // (a store between), were 13% of the kernel's shared-memory wavefronts (ncu26).
  static_assert(kRows / 16 * (kRows / 16) == kWarps, "one tile of Y a warp");
  const int y_m0 = warp / 4 * 16, y_n0 = warp % 4 * 16;
  float y[8] = {};
  // The quarters: dv_new's two (V's), then dw's two (K's). Y's column j takes beta_j (V's) and
  // beta_j E_j r_k,j (K's: beta E K with K = k r_k) after its exact product with the raw rows.
  // The quarters are bfloat16 values (dv_new's since 2bc5023, dw's since dqkwg writes it so), exact
  // in p's hi plane: its lo plane is neither written nor read (kAExact in Y's product, kBExact in
  // dR's), one product for two and two for three, the bits of planes with a zero lo plane.
  const auto quarter = [&](int q, auto keys_t) {
    constexpr bool keys = decltype(keys_t)::value;
    const int c0 = q % 2 * kQ;
    wait_copies();
    __syncthreads();  // the quarter before is done with p (and the norms and this quarter's floats are in)
    {  // the staged quarter into p's hi plane as it is (exact: no lo plane), 16 bytes a thread
      static_assert(kRows * kQ / 8 == kThreads, "a piece a thread");
      const int r = tid / (kQ / 8), c = tid % (kQ / 8) * 8;
      *reinterpret_cast<uint4*>(m.p + r * kPlane64 + c) = *reinterpret_cast<const uint4*>(staged + r * 2 * kPitch64 + c);
    }
    __syncthreads();
    if (q < 3) fetch(q + 1);  // in flight over the products (and the value row loop)
    plane_gemm<2, false, true, true, true>(m.p, kPlane64, kLo64, (keys ? m.k : m.v) + c0, kPlaneRow, 0, kRows,
                                            kRows, kQ, [&](int r, int c, float val) {
                                              const float x = keys ? val * s.beta[c] * s.E[c] * m.rk[c]
                                                                   : val * s.beta[c];
                                              // constant indices once inlined (y stays in registers)
                                              float& at = y[(c >> 3 & 1) * 4 + (r >> 3 & 1) * 2 + (c & 1)];
                                              at = q == 0 ? x : at + x;
                                            });
    // dR's quarter = Ai^T (the quarter): the values' into dr, the keys' into D's columns c0..
    plane_gemm<2, true, false, true, false, kNever, kNever, Tri::kUpperA>(
        m.ai, kPlane64, kLo64, m.p, kPlane64, kLo64, kRows, kQ, kRows, [&](int r, int c, float val) {
          if constexpr (keys) m.D[r * kLdD + c0 + c] = val;
          else m.dr[r * kLdR + c] = val;
        });
    if constexpr (keys) return;
    __syncthreads();
    // v's gradient beta dR_V, and V . dR_V, two of the warp's rows side by side: one row at a time,
    // each row's shuffles waited on each other after the row before's (ncu26: SASS 1220-1285, 4% of
    // the stall samples; four rows at a time spilled)
#pragma unroll 1
    for (int i0 = warp; i0 < kRows; i0 += 2 * kWarps) {
      float sv[2];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int i = i0 + n * kWarps;
        const int64_t tok = s.slot[i];
        __nv_bfloat16* dv_row = tok < p.T ? dv + (tok * p.hv + h) * 128 + c0 + lane : nullptr;
        sv[n] = 0.0f;
#pragma unroll
        for (int u = 0; u < kQ / 32; ++u) {
          const int c = lane + 32 * u;
          const float dr = m.dr[i * kLdR + c];
          sv[n] += __bfloat162float(m.v[i * kPlaneRow + c0 + c]) * dr;
          if (tok < p.T) dv_row[32 * u] = __float2bfloat16_rn(s.beta[i] * dr);
        }
      }
      // the two rows' sums together, row n's in lanes 16 n .. 16 n + 15 (warp_sums: 5 shuffles for 10)
      const float x = warp_sums(sv);
      if (lane % 16 == 0) m.sv[i0 + lane / 16 * kWarps] += x;
    }
  };
#pragma unroll 1
  for (int q = 0; q < 2; ++q) quarter(q, std::false_type{});
#pragma unroll 1
  for (int q = 2; q < 4; ++q) quarter(q, std::true_type{});
  __syncthreads();  // dR_K is in; p is free
  // Y as planes into p: the warps' tiles from y (a lane's pairs of columns, 4 g + t a row's lanes:
  // conflict free at kPlane64's pitch)
#pragma unroll
  for (int n = 0; n < 8; n += 2) {
    const int r = y_m0 + lane / 4 + n % 4 / 2 * 8, c = y_n0 + n / 4 * 8 + lane % 4 * 2;
    store_split2(m.p + r * kPlane64 + c, kLo64, y[n], y[n + 1]);
  }
  __syncthreads();
  // Ai^T Y into Y (its planes are read), then its planes into p, then dM = -(Ai^T Y) Ai^T, strictly
  // lower, into Y.
  plane_gemm<2, true, false, false, false, kNever, kNever, Tri::kUpperA>(
      m.ai, kPlane64, kLo64, m.p, kPlane64, kLo64, kRows, kRows, kRows,
      [&](int r, int c, float val) { m.Y[r * kPitch64 + c] = val; });
  __syncthreads();
  // KKL's values for the warp's four rows, loaded before dM's product: read where used, each row's
  // first products waited on memory (ncu26: 2,343 long-scoreboard samples on l's first FMUL, 3.5%);
  // loaded after the product (before the barrier), still 463 (ncu27, 0.8%). The row loop unrolled so
  // that they stay in registers (and its rows' instructions interleave).
  const float* kkl = p.kkl + rows * kRows;
  float kl[kRows / kWarps][kRows / 32];
#pragma unroll
  for (int n = 0; n < kRows / kWarps; ++n) {
#pragma unroll
    for (int u = 0; u < kRows / 32; ++u) kl[n][u] = kkl[(warp + n * kWarps) * kRows + lane + 32 * u];
  }
  // Ai^T Y's planes into p, a pair of columns a thread (load_split's four floats in flight cost this
  // kernel's 64 registers a spill).
#pragma unroll
  for (int u = 0; u < kRows * kRows / 2 / kThreads; ++u) {
    const int idx = tid + u * kThreads, r = idx / (kRows / 2), c = idx % (kRows / 2) * 2;
    store_split2(m.p + r * kPlane64 + c, kLo64, m.Y[r * kPitch64 + c], m.Y[r * kPitch64 + c + 1]);
  }
  __syncthreads();
  plane_gemm<2, false, true, false, false, kNever, kNever, Tri::kUpperB | Tri::kLowerC>(
      m.p, kPlane64, kLo64, m.ai, kPlane64, kLo64, kRows, kRows, kRows,
      [&](int r, int c, float val) { m.Y[r * kPitch64 + c] = c < r ? -val : 0.0f; });
  __syncthreads();
  // Row by row: beta's and G's gradients; Z = beta KKL dM (G's gradient through L) into p's bytes;
  // (C + C^T) diag(r_k) in bfloat16 into ai's, C = beta L dM strictly lower, each row forming its
  // own row of the sum (C's (i, j) for j < i, C's (j, i) for j > i) from dM.
  float* dM = m.Y;
  // Z [64, 65]: antisymmetric_row_sum's column reads two-way, not 8-way, bank conflicted (ncu26: its
  // eight LDS at eight times their ideal wavefronts, 4% of the kernel's shared wavefronts in excess)
  constexpr int kLdZ = kRows + 1;
  static_assert(kRows * kLdZ * sizeof(float) <= 2 * kLo64 * sizeof(__nv_bfloat16), "Z in p's bytes");
  float* Z = reinterpret_cast<float*>(m.p);
  auto* c_rk = m.ai;
  // The rows' lane sums, sums[2 n] of k . dR_K and sums[2 n + 1] of KKL . dM (row warp + n kWarps),
  // summed over the warp together after the loop (warp_sums: 10 shuffles and 9 additions): each row's
  // two warp_sum took 40 of each a warp (ncu27: their FADDs waiting on the shuffles, 1,064
  // short-scoreboard samples, 1.9% of the kernel's).
  float sums[2 * (kRows / kWarps)];
#pragma unroll
  for (int n = 0; n < kRows / kWarps; ++n) {
    const int i = warp + n * kWarps;
    float sk = 0.0f, sa = 0.0f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = lane + 32 * u;
      sk += __bfloat162float(m.k[i * kPlaneRow + c]) * m.D[i * kLdD + c];
    }
#pragma unroll
    for (int u = 0; u < kRows / 32; ++u) {
      const int j = lane + 32 * u;
      const float dm = dM[i * kPitch64 + j], l = kl[n][u];
      sa += l * dm;
      Z[i * kLdZ + j] = s.beta[i] * l * dm;
      // C's (i, j) below the diagonal, (j, i) above it: one expression on the chosen operands (as two
      // branches, a warp whose lanes straddle i ran both)
      const bool below = j < i;
      const int a = below ? i : j, b = below ? j : i;
      const float dab = below ? dm : dM[j * kPitch64 + i];
      const float c = j != i ? s.beta[a] * decay(s, a, b) * dab : 0.0f;
      c_rk[i * kPlane64 + j] = __float2bfloat16_rn(c * m.rk[j]);
    }
    sums[2 * n] = sk;
    sums[2 * n + 1] = sa;
  }
  {  // row n's sums: k . dR_K in lanes 8 n .. 8 n + 3, KKL . dM in lanes 8 n + 4 .. 8 n + 7
    static_assert(2 * (kRows / kWarps) == 8, "a row's two sums in eight lanes");
    const float x = warp_sums(sums), sa = __shfl_xor_sync(0xffffffffu, x, 4);
    if (lane % 8 == 0) {
      const int i = warp + lane / 8 * kWarps;
      const int64_t tok = s.slot[i];
      const float sk = m.rk[i] * x;
      if (tok < p.T) p.dbeta[tok * p.hv + h] = m.sv[i] + s.E[i] * sk + sa;
      m.dG[i] = static_cast<double>(s.beta[i]) * s.E[i] * sk;
    }
  }
  // dk_part's values for the warp's tile of k's gradient below (one 16 x 32 tile a warp, tile = warp:
  // rows dk_m0 + g, + 8; columns dk_n0 + 8 j + 2 t, + 1), loaded before the barrier: read in the
  // product's epilogue, each pair's store waited on memory (ncu27: 2,540 long-scoreboard samples on
  // its FADDs, 4.5% of the kernel's). After the barrier, they were issued in the product's tile
  // (sunk past the float64 row sums); with beta E of the tile's rows also held, 8 bytes spilled.
  static_assert(kRows / 16 * (128 / 32) == kWarps, "one 16 x 32 tile of k's gradient a warp");
  const int dk_m0 = warp / 4 * 16, dk_n0 = warp % 4 * 32;
  float2 part[4][2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      part[j][e] = *reinterpret_cast<const float2*>(p.dk_part + (rows + dk_m0 + lane / 4 + 8 * e) * 128 + dk_n0 +
                                                    8 * j + lane % 4 * 2);
    }
  }
  __syncthreads();
  if (const double z = antisymmetric_row_sum<kLdZ>(Z); tid % kRowThreads == 0) {
    m.dG[tid / kRowThreads] += z + p.dg_part[rows + tid / kRowThreads];
  }
  // k's gradient: dk_part + ((C + C^T) diag(r_k) k + beta E dR_K), over dR_K in D.
  plane_gemm<4, false, false, true, true>(c_rk, kPlane64, 0, m.k, kPlaneRow, 0, kRows, 128, kRows,
                                          [&](int r, int c, float v0, float v1) {
                                            float* at = m.D + r * kLdD + c;
                                            const float be = s.beta[r] * s.E[r];
                                            // constant indices once inlined (part stays in registers)
                                            const float2 pr = part[c >> 3 & 3][r >> 3 & 1];
                                            store2(at, pr.x + (v0 + be * at[0]), pr.y + (v1 + be * at[1]));
                                          });
  __syncthreads();
  // k's gradient through the norm, normalised_backward's for each row, two of the warp's rows side by
  // side and their dots summed over the warp together (warp_sums, then each broadcast from its first
  // lane): a row at a time, each row's warp_sum waited on the one before's (ncu27: their FADDs 1,148
  // short-scoreboard samples, 2.0%). Four rows a batch spilled 12 bytes.
  {
    constexpr int kB = 2;  // rows a batch
#pragma unroll
    for (int n0 = 0; n0 < kRows / kWarps; n0 += kB) {
      float y[kB][4], dy[kB][4], dots[kB];
#pragma unroll
      for (int n = 0; n < kB; ++n) {
        const int i = warp + (n0 + n) * kWarps;
        const __nv_bfloat16* k = m.k + i * kPlaneRow;
        const float r = m.rk[i];
        dots[n] = normalised_terms(y[n], dy[n], [&](int c) { return __bfloat162float(k[c]) * r; }, m.D + i * kLdD, 128,
                                   1.0f);
      }
      const float x = warp_sums(dots);
#pragma unroll
      for (int n = 0; n < kB; ++n) {
        const int i = warp + (n0 + n) * kWarps;
        const int64_t tok = s.slot[i];
        const float dot = __shfl_sync(0xffffffffu, x, 32 / kB * n), r = m.rk[i];
        if (tok < p.T) normalised_write(m.D + i * kLdD, r, y[n], dy[n], dot, 128);  // (in place, as read)
      }
    }
  }
  scan64(m.dG, true);  // g_s's gradient: the sum of G_i's over i >= s
  __syncthreads();
  if (tid < kRows && s.slot[tid] < p.T) p.dg[s.slot[tid] * p.hv + h] = m.dG[tid];
  sum_over_value_heads(m.D, kLdD, p.dk_keys, s, p, b.kh);
}

// A side stream forked from the current one (`use`; else the current one itself), joined back at
// join() or, on an exception, when it leaves scope: declared after the tensors the side stream
// writes, it joins before they go back to the main stream's cache.
class SideStream {
 public:
  explicit SideStream(bool use)
      : main_(at::cuda::getCurrentCUDAStream()), side_(use ? c10::cuda::getStreamFromPool() : main_) {
    if (side_ != main_) order(side_, main_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    try {
      join();
    } catch (...) {
      cudaStreamSynchronize(side_.stream());  // no order to be had: the side stream's work done
    }
  }
  c10::cuda::CUDAStream stream() const { return side_; }
  void join() {
    if (side_ != main_ && !joined_) {
      order(main_, side_);
      joined_ = true;
    }
  }

 private:
  // `waiter` runs its later work after what is queued on `done` now.
  static void order(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& done) {
    cudaEvent_t event;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event, done.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter.stream(), event, 0));
    C10_CUDA_CHECK(cudaEventDestroy(event));  // (freed once the wait is done with it)
  }
  c10::cuda::CUDAStream main_, side_;
  bool joined_ = false;
};

// The key heads' gradients from the value heads' shares: out [rows, D] (T) = the sum over r of x
// [rows, r, D] (float32), in one pass, four columns a thread (ATen's sum, then the cast, took two
// passes over the float32 shares: 0.27 ms of the backward at 8,192 tokens on the H200).
template <typename T>
__global__ void __launch_bounds__(256) sum_value_heads_kernel(const float* x, T* out, int64_t quads, int r, int D) {
  const int per_row = D / 4;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, c = i % per_row * 4;
    float4 acc = *reinterpret_cast<const float4*>(x + row * r * D + c);
    for (int j = 1; j < r; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(x + (row * r + j) * D + c);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    T* o = out + row * D + c;
    o[0] = from_float<T>(acc.x);
    o[1] = from_float<T>(acc.y);
    o[2] = from_float<T>(acc.z);
    o[3] = from_float<T>(acc.w);
  }
}

// x [T, hv, D] float32 summed over each key head's hv / hk value heads, as T [T, hk, D].
template <typename T>
at::Tensor sum_value_heads(const at::Tensor& x, int hk, at::ScalarType dtype) {
  const int64_t tokens = x.size(0), hv = x.size(1), D = x.size(2);
  if (D % 4 != 0) return x.view({tokens, hk, hv / hk, D}).sum(2).to(dtype);  // (the drawn narrow widths)
  at::Tensor out = at::empty({tokens, hk, D}, x.options().dtype(dtype));
  const int64_t quads = tokens * hk * D / 4;
  if (quads == 0) return out;
  const int blocks = static_cast<int>(std::min<int64_t>((quads + 255) / 256, 8 * 132));
  sum_value_heads_kernel<T><<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), static_cast<T*>(out.data_ptr()), quads, static_cast<int>(hv / hk), static_cast<int>(D));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ---- Host ------------------------------------------------------------------------------------------

// The dynamic shared memory of a kernel whose carve is Smem.
template <typename Smem>
size_t smem_bytes(const Dims& d) {
  Carve carve{nullptr};
  const Smem layout(carve, d);
  return carve.used;
}

// cluster_y > 0: in clusters of (1, cluster_y) blocks (a chunk's value heads of one key head:
// sum_over_value_heads), which a cluster of 1 takes too. max_carveout: the largest shared-memory
// carve-out asked, for a kernel whose blocks a multiprocessor fit only in it.
template <typename Smem, int Threads = kThreads, typename Kernel, typename A>
void launch(Kernel kernel, dim3 grid, const Dims& d, const A& args, unsigned cluster_y = 0, bool max_carveout = false) {
  const size_t bytes = smem_bytes<Smem>(d);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (max_carveout)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
  if (cluster_y == 0) {
    kernel<<<grid, Threads, bytes, at::cuda::getCurrentCUDAStream()>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(Threads);
  config.dynamicSmemBytes = bytes;
  config.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = cluster_y;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

// The plane kernels' variants on Hopper (V4TRAIN_GDR_VARIANTS, a comma list; unset: all four; `none`:
// none, the kernels devices after Hopper run, judged there by parity/test_gated_delta_rule.py):
// `wgmma`, the recurrence on warpgroup products (recurrence_wgmma_kernel, where the sm_90a build runs),
// `prepare3`, prepare_planes_kernel at three blocks a multiprocessor (at two without it), and
// and `output_wgmma` and `local_wgmma`, the output and local_grads on warpgroup products
// (output_wgmma_kernel, local_wgmma_kernel: 0.597 and 0.513 ms at 32K against their planes kernels' 0.926
// and 0.653, H100). dqkwg, prepare and wy_grads on warpgroup products (one warpgroup a block) were run and
// removed in the fortieth session: no faster than their planes kernels, or wrong (docs/benchmarks.md).
enum Variant : unsigned { kWgmma = 1, kPrepare3 = 2, kOutputWgmma = 4, kLocalWgmma = 8 };
inline unsigned variants() {
  return env_variants("V4TRAIN_GDR_VARIANTS",
                      {"wgmma", "prepare3", "output_wgmma", "local_wgmma"},
                      kWgmma | kPrepare3 | kOutputWgmma | kLocalWgmma);
}

// fold (kPlanes, the backward): add = eq^T d_o formed in the kernel (RecurrenceArgs), r.add undefined.
template <Mode kMode, typename DimsT>
void recurrence(const Recurrence& r, const Plan& plan, const Dims& d, const Args* fold = nullptr) {
  TORCH_CHECK(plan.documents < 65536, "v4_gated_delta_rule: more than 65,535 documents in one call");
  RecurrenceArgs a{r.base.data_ptr(), r.a.data_ptr<float>(), r.b.data_ptr<float>(),
                   r.add.defined() ? r.add.data_ptr<float>() : nullptr, r.decay.data_ptr<float>(),
                   r.state_out.data_ptr(), r.x_out.data_ptr(), plan.chunks_of.data_ptr<int64_t>(),
                   plan.offset_device.data_ptr<int64_t>(), static_cast<float>(r.sign_a), static_cast<float>(r.sign_b),
                   static_cast<int>(r.base.size(1)), d.dk, d.dv, r.reverse};
  const dim3 grid((d.dv + kCols - 1) / kCols, r.base.size(1), plan.documents);
  if constexpr (kPlanes<kMode, DimsT>) {
    TORCH_CHECK(!r.add.defined(), "v4_gated_delta_rule: the plane kernels' recurrence takes no add (the backward's "
                                  "is folded)");
    TORCH_CHECK(r.x_out.scalar_type() == at::kBFloat16,
                "v4_gated_delta_rule: the plane kernels' recurrence writes v_new and dv_new in bfloat16");
    TORCH_CHECK(r.base.scalar_type() == at::kBFloat16,
                "v4_gated_delta_rule: the plane kernels' recurrence takes U and dv_local in bfloat16");
    if (fold != nullptr) {
      a.eq = fold->eq;
      a.d_o = static_cast<const __nv_bfloat16*>(fold->d_o);
      a.slots = fold->slots;
      a.T = fold->T;
    }
    // Hopper's warpgroup products where the sm_90a build runs; elsewhere (a later device, on the PTX)
    // the warps' mma.sync, which V4TRAIN_GDR_VARIANTS without wgmma also takes on Hopper (variants()).
    // (The wgmma kernel stores sign_b x for x, exact only for a sign: every caller's sign_b is +-1.)
    TORCH_CHECK(std::abs(r.sign_b) == 1.0, "v4_gated_delta_rule: the plane kernels' recurrence takes sign_b +-1, got ",
                r.sign_b);
    const bool wgmma_on = variants() & kWgmma;
    const auto on = [&]<bool kFold>() {
      if (wgmma_on && wgmma::capable(r.base.get_device(), smem_bytes<WgRecurrenceSmem<kFold>>(d)))
        launch<WgRecurrenceSmem<kFold>, kWgThreads>(recurrence_wgmma_kernel<DimsT, kFold>, grid, d, a);
      else
        launch<PlanesSmem<kFold>>(recurrence_planes_kernel<DimsT, kFold>, grid, d, a);
    };
    if (fold != nullptr) on.template operator()<true>();
    else on.template operator()<false>();
  } else {
    TORCH_CHECK(fold == nullptr && r.base.scalar_type() == at::kFloat,
                "v4_gated_delta_rule: the folded recurrence is the plane kernels'; the others take a float32 base");
    launch<RecurrenceSmem>(recurrence_kernel<kMode, DimsT>, grid, d, a);
  }
}

template <typename T, Mode kMode, typename DimsT>
void fused(Fused& f, bool backward) {
  static_assert(!kPlanes<kMode, DimsT> || std::is_same_v<T, __nv_bfloat16>, "the plane kernels read bfloat16 inputs");
  const c10::cuda::CUDAGuard guard(f.q.device());
  const int64_t T_ = f.q.size(0), chunks = f.slots.numel() / kRows;
  const int hk = f.q.size(1), hv = f.v.size(1);
  const Dims d(f.q.size(2), f.v.size(2));
  const auto f32 = f.q.options().dtype(at::kFloat);
  // The states across chunks (h, d_state) and the values between passes (U, v_new): bfloat16 for the
  // plane kernels, which take them rounded.
  const auto states = kPlanes<kMode, DimsT> ? f.q.options().dtype(at::kBFloat16) : f32;
  const auto rows = [&](int64_t width) { return at::empty({chunks, hv, kRows, width}, f32); };
  const auto values = [&] { return at::empty({chunks, hv, kRows, d.dv}, states); };  // U, v_new, dv_local, dv_new
  Args a{};
  a.q = f.q.data_ptr();
  a.k = f.k.data_ptr();
  a.v = f.v.data_ptr();
  a.g = f.g.data_ptr<double>();
  a.beta = f.beta.data_ptr<float>();
  a.slots = f.slots.data_ptr<int64_t>();
  a.T = T_;
  a.hk = hk;
  a.hv = hv;
  a.dk = d.dk;
  a.dv = d.dv;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.dk)));
  const dim3 grid(chunks, hv);
  // W, Kt and gamma (and U in the forward pass: bfloat16 on planes, as the recurrence's base reads it;
  // tools/delta_rule_split_check.py --stored u: A_log's worst error as without it).
  at::Tensor u = backward ? at::Tensor() : values();
  at::Tensor w = rows(d.dk), k_tilde = rows(d.dk), gamma = at::empty({chunks, hv}, f32);
  a.u = backward ? nullptr : u.data_ptr();
  a.w = w.data_ptr<float>();
  a.k_tilde = k_tilde.data_ptr<float>();
  a.gamma = gamma.data_ptr<float>();
  // The backward's Ai and L * K K^T, from prepare to wy_grads (as many bytes as W at Qwen3.5's widths).
  at::Tensor ai = backward ? rows(kRows) : at::Tensor(), kkl = backward ? rows(kRows) : at::Tensor();
  a.ai = backward ? ai.data_ptr<float>() : nullptr;
  a.kkl = backward ? kkl.data_ptr<float>() : nullptr;
  // In the backward pass prepare's recomputation and local_grads need nothing of each other: prepare
  // runs on a side stream beside local_grads, so that their blocks share the multiprocessors (each
  // kernel alone waits on latency at one or two blocks a multiprocessor). The main stream waits for
  // it before the recurrence (or, on an exception, before w, k_tilde and gamma are freed).
  SideStream prepare_stream(backward);
  {
    const c10::cuda::CUDAStreamGuard on(prepare_stream.stream());
    if constexpr (!kPlanes<kMode, DimsT>) {
      launch<PrepareSmem, kPrepareThreads>(prepare_kernel<T, kMode, DimsT>, grid, d, a);
    } else if (variants() & kPrepare3) {  // (three blocks: 224 of the 228 KB)
      launch<PreparePlanesSmem, kPrepareThreads>(prepare_planes_kernel<DimsT, 3>, grid, d, a, 0, true);
    } else {
      launch<PreparePlanesSmem, kPrepareThreads>(prepare_planes_kernel<DimsT, 2>, grid, d, a);
    }
  }
  if (!backward) {
    Recurrence r{u, w, k_tilde, at::Tensor(), gamma, -1.0, 1.0, false};
    r.state_out = at::empty({chunks, hv, d.dk, d.dv}, states);
    // v_new as the states: bfloat16 on planes (what their products take, kept for the backward in half the bytes)
    r.x_out = values();
    recurrence<kMode, DimsT>(r, f.plan, d);
    f.h = r.state_out;
    f.v_new = r.x_out;
    f.o = at::empty_like(f.v);
    a.h = f.h.data_ptr();
    a.v_new = f.v_new.data_ptr();
    a.o = f.o.data_ptr();
    if constexpr (kPlanes<kMode, DimsT>) {
      // (its copies of q's and k's rows are 16 bytes each: output_planes copies unaligned rows by elements)
      if ((variants() & kOutputWgmma) && aligned16(a.q) && aligned16(a.k) &&
          wgmma::capable(f.q.get_device(), smem_bytes<WgOutputSmem>(d)))
        launch<WgOutputSmem, kWgThreads>(output_wgmma_kernel<DimsT>, grid, d, a);
      else
        launch<OutputPlanesSmem>(output_planes_kernel<DimsT>, grid, d, a);
    } else {
      launch<OutputSmem>(output_kernel<T, kMode, DimsT>, grid, d, a);
    }
    return;
  }
  a.h = f.h.data_ptr();
  a.v_new = f.v_new.data_ptr();
  if constexpr (kPlanes<kMode, DimsT>) f.d_o = dense16(f.d_o);  // (the folded recurrence reads 16 bytes at a time)
  a.d_o = f.d_o.data_ptr();
  // dh_local, the state's gradient from each chunk's outputs ((E Q)^T d_o): written by local_grads
  // and added by the reverse recurrence, or on planes formed there from E Q rounded (`fold`).
  constexpr bool fold = kPlanes<kMode, DimsT>;
  // dv_local: bfloat16 on planes (tools/delta_rule_split_check.py --stored dv_local: A_log's worst error and g's
  // distance from float32 on the long documents as without it), the recurrence's base.
  Recurrence r{values(), k_tilde, w, fold ? at::Tensor() : at::empty({chunks, hv, d.dk, d.dv}, f32), gamma, 1.0, -1.0,
               true};
  at::Tensor eq = fold ? at::empty({chunks, hv, kRows, d.dk}, f.q.options().dtype(at::kBFloat16)) : at::Tensor();
  a.dv_local = r.base.data_ptr();
  if constexpr (fold) {
    a.eq = static_cast<__nv_bfloat16*>(eq.data_ptr());
    // (its copies of q's, k's and d_o's rows are 16 bytes each: local_grads_planes copies unaligned rows by elements)
    if ((variants() & kLocalWgmma) && aligned16(a.q) && aligned16(a.k) &&
        wgmma::capable(f.q.get_device(), smem_bytes<WgLocalSmem>(d)))
      launch<WgLocalSmem, kWgThreads>(local_wgmma_kernel<DimsT>, grid, d, a, 0, true);  // (four blocks: 214 of 228 KB)
    else
      launch<LocalPlanesSmem>(local_grads_planes_kernel<DimsT>, grid, d, a);
  } else {
    a.dh_local = r.add.data_ptr<float>();
    launch<LocalSmem>(local_grads_kernel<T, kMode, DimsT>, grid, d, a);
  }
  prepare_stream.join();
  r.state_out = at::empty({chunks, hv, d.dk, d.dv}, states);
  r.x_out = values();  // dv_new: bfloat16 on planes, as v_new
  recurrence<kMode, DimsT>(r, f.plan, d, fold ? &a : nullptr);
  r.base.reset();
  r.add.reset();
  eq.reset();
  a.d_state = r.state_out.data_ptr();
  a.dv_new = r.x_out.data_ptr();
  a.dw = w.data_ptr<float>();  // W is done with: its gradient takes its place
  // Off planes state_grads hands intra_grads its products through memory; d_state is free after it,
  // before intra_grads' outputs are allocated (on planes dqkwg keeps those products in shared memory).
  at::Tensor dq_state, dk_tilde, dgamma;
  if constexpr (!kPlanes<kMode, DimsT>) {
    dq_state = rows(d.dk);
    dk_tilde = rows(d.dk);
    dgamma = at::empty({chunks, hv}, f32);
    a.dq_state = dq_state.data_ptr<float>();
    a.dk_tilde = dk_tilde.data_ptr<float>();
    a.dgamma = dgamma.data_ptr<float>();
    launch<StateSmem>(state_grads_kernel<T, kMode, DimsT>, grid, d, a);
    r.state_out.reset();
  }
  // Key heads serve hv / hk value heads each: their gradients sum over them, on planes in the
  // kernels' clusters (a chunk's value heads of a key head), else by sum_value_heads after them.
  constexpr bool planes = kPlanes<kMode, DimsT>;
  const auto keys = [&] { return at::empty({T_, hk, d.dk}, f.q.options()); };
  at::Tensor dq = planes ? keys() : at::empty({T_, hv, d.dk}, f32), dk_part = rows(d.dk);
  at::Tensor dg_part = at::empty({chunks, hv, kRows}, f32.dtype(at::kDouble));
  a.dk_part = dk_part.data_ptr<float>();
  a.dg_part = dg_part.data_ptr<double>();
  const auto cluster = static_cast<unsigned>(hv / hk);
  if constexpr (planes) {
    a.dq_keys = static_cast<__nv_bfloat16*>(dq.data_ptr());
    launch<DqkwgSmem>(dqkwg_planes_kernel<DimsT>, grid, d, a, cluster);
  } else {
    a.dq = dq.data_ptr<float>();
    launch<IntraSmem>(intra_grads_kernel<T, kMode, DimsT>, grid, d, a);
  }
  r.state_out.reset();
  at::Tensor dk = planes ? keys() : at::empty({T_, hv, d.dk}, f32);
  f.dv = at::empty_like(f.v);
  f.dbeta = at::empty({T_, hv}, f32);
  f.dg = at::empty({T_, hv}, f32.dtype(at::kDouble));
  a.dv_out = f.dv.data_ptr();
  a.dbeta = f.dbeta.data_ptr<float>();
  a.dg = f.dg.data_ptr<double>();
  if constexpr (planes) {
    a.dk_keys = static_cast<__nv_bfloat16*>(dk.data_ptr());
    launch<WyPlanesSmem>(wy_grads_planes_kernel<DimsT>, grid, d, a, cluster);
    f.dq = dq;
    f.dk = dk;
  } else {
    a.dk_out = dk.data_ptr<float>();
    launch<WySmem>(wy_grads_kernel<T, kMode, DimsT>, grid, d, a);
    f.dq = sum_value_heads<T>(dq, hk, f.q.scalar_type());
    f.dk = sum_value_heads<T>(dk, hk, f.q.scalar_type());
  }
}

template <typename T, Mode kMode>
void fused_any_width(Fused& f, bool backward) {
  // (the plane kernels sum a key head's value heads in a cluster: at most 8 blocks, the portable size)
  if (f.q.size(2) == 128 && f.v.size(2) == 128 && f.v.size(1) / f.q.size(1) <= kMaxCluster)
    return fused<T, kMode, FixedDims<128, 128>>(f, backward);
  fused<T, kMode, Dims>(f, backward);
}

void fused_cuda(Fused& f, bool backward) {
  switch (f.q.scalar_type()) {
    case at::kFloat: return fused_any_width<float, Mode::kFp32>(f, backward);
    case at::kBFloat16: return fused_any_width<__nv_bfloat16, Mode::kTf32x3>(f, backward);
    default: TORCH_CHECK(false, "v4_gated_delta_rule: the fused kernels take float32 or bfloat16, got ",
                         f.q.scalar_type());
  }
}

const Backend<FusedKernel>::Register registered(c10::DeviceType::CUDA, &fused_cuda);

}  // namespace
}  // namespace v4::gdr
