// The routed experts' grouped product on FP8 weights (issue 16): each row of x, grouped by
// expert, times its expert's float8_e4m3fn weight [E, out, in] with 128 x 128 block scales, the
// weight dequantised tile by tile in shared memory inside the GEMM. Dequantising whole experts
// first (fp8.cu's pass, a bf16 copy written and read back) was 9.3 ms of the GLM-5 proxy's 200 ms
// FP8 step, most of it the experts (docs/benchmarks.md). One kernel both ways: y = x W_e^T (the
// forward) and dx = dy W_e (the backward, the same tile read transposed by the product's
// descriptor). Warpgroups 0 and 1 multiply (wgmma, bf16 operands, fp32 accumulators; half the
// tile's rows each); in warpgroup 2 one thread has x's tiles copied by TMA and all turn the weight's
// bytes into bf16, in a ring of kStages stages, each value float(w) * scale in fp32 rounded once, as
// fp8.cu does: the products are dequantise-then-grouped-GEMM's up to the order of their sums. The
// copying warps bound the kernel (ncu, 2026-12-05: the products waited on them three quarters of the
// time while x's copies and the addresses were over half their instructions); so x goes by TMA and
// every address a step is its first plus a constant. Both ways now run on fp8_registers_kernel
// (below); this kernel is the variant `staged`, kept as the registers kernel's bit-for-bit reference.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cc/common/backend.h"
#include "cc/common/fp8.cuh"
#include "cc/common/lora.h"
#include "cc/common/mma_sync.cuh"
#include "cc/common/wgmma.cuh"

namespace v4::cuda {
namespace {

constexpr int kBK = 64;           // the sum's step: one 128-byte swizzled row of bf16
constexpr int kStages = 4;        // the ring: the copies run up to this many steps ahead
constexpr int kScaleBlock = 128;  // the checkpoints' scale block: 128 x 128 weights
// The epilogue: a multiplying warp writes its 16 rows x 64 columns of the result into shared memory
// (144 bytes a row: the 8 rows of a fragment's store fall on 32 different banks), then each lane
// copies 16 bytes of a row out, so a warp's stores to y are whole 128-byte rows, not 8 rows of 16 bytes.
constexpr int kEpiloguePitch = 144, kEpilogueBytes = 8 * 16 * kEpiloguePitch;
constexpr int kThreads = 384;     // warpgroups 0, 1: the products; 2: the copies

// A block's tile: BM rows of x (BM / 2 a multiplying warpgroup, in products of 64 rows) by BN
// output columns. 128 x 256 or 256 x 128: 128 accumulators a thread either way; the second
// converts half the weights a step for the same products (the copies' conversions are most of
// their instructions), and its products read the weight tile twice (a fifth more shared-memory
// reads a step).
template <int BM_, int BN_>
struct Shape {
  static constexpr int BM = BM_, BN = BN_, kSub = BM / 128;  // products of 64 rows a warpgroup
  static constexpr int kXTile = BM * kBK * 2, kWTile = BN * kBK * 2, kStageBytes = kXTile + kWTile;
  static constexpr int kPieces = BN * kBK / 16 / 128;  // 16-byte FP8 loads a copying thread a step
  static constexpr int kHalves = BN / kScaleBlock;      // scale blocks across the tile's columns
  // After the ring: its barriers (128 bytes), then each multiplying warp's staging rows (kEpilogue).
  static constexpr size_t kSmem = size_t(kStages) * kStageBytes + 128 + kEpilogueBytes + 1024;
};
using Wide = Shape<128, 256>;
using Tall = Shape<256, 128>;

// x [rows, K], rows grouped by expert, comes as a TMA map (wgmma::tensor_map_swizzled: boxes of BM x 64).
struct Args {
  const uint8_t* w;        // [E, out, in] row-major
  const float* scale;      // [E, out / 128, in / 128]
  const int* offsets;      // [E]: the end of each expert's rows
  __nv_bfloat16* y;        // [rows, N]
  int E, out, in;
};

// The row tiles: each expert's rows in tiles of BM, ceil(rows_e / BM) tiles an expert, counted
// expert after expert. Every warp finds its tiles itself (32 experts a round, a scan over its lanes).
struct Tile {
  int expert, first, end;  // the expert (-1: none) and the tile's rows [first, min(first + BM, end))
};

// Tile `tile`'s expert and rows (of E experts from `first` on, whose rows end at offsets[first..]: the
// expert counted from first); with tile < 0, Tile{-1, the number of tiles, 0}.
template <int BM>
__device__ Tile find_tile(const int* offsets, int E, int tile, int first = 0) {
  const int lane = threadIdx.x % 32;
  int before = 0;  // the tiles of the rounds before
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane, g = first + e;
    const int start = e < E && g > 0 ? offsets[g - 1] : 0, end = e < E ? offsets[g] : 0;
    const int tiles = e < E ? (end - start + BM - 1) / BM : 0;
    int upto = tiles;
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, upto, o);
      if (lane >= o) upto += v;
    }
    const int mine = before + upto - tiles;
    const unsigned who = __ballot_sync(0xffffffffu, tile >= mine && tile < mine + tiles);
    if (who != 0) {
      const int src = __ffs(int(who)) - 1;
      return Tile{__shfl_sync(0xffffffffu, e, src), __shfl_sync(0xffffffffu, start + (tile - mine) * BM, src),
                  __shfl_sync(0xffffffffu, end, src)};
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
  }
  return Tile{-1, before, 0};
}

// Four e4m3 weights (a 32-bit word, weight 0 in its low byte) as two f16 pairs, exactly: the
// register's halves read in place (a shift of the word for its high half was 4 of 52 instructions
// a piece).
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t in, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(in));
}

// A bf16 pair (lo in the low half) of two floats, each rounded once.
[[maybe_unused]] __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// An f16 pair of e4m3 weights (exact) times s in fp32, each rounded once to bf16.
[[maybe_unused]] __device__ __forceinline__ uint32_t scaled_pair(uint32_t half2, float s) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&half2));
  return pack_bf16(f.x * s, f.y * s);
}

// 16 FP8 weights (one 16-byte piece) times their scale in fp32, each rounded once to bf16 (fp8.cu's
// dequantisation, value for value; e4m3 -> half -> float is exact): weights 0-7 in lo, 8-15 in hi.
// The fp32 product cannot go: rounding q s once to bf16 differs from rounding its fp32 value in
// about 7 of a million pairs (a helper's exhaustive check), so no packed bf16 product. (Unused
// where the kernels compile empty, for devices without wgmma.)
[[maybe_unused]] __device__ __forceinline__ void dequantize16(const uint4& v, float s, uint4& lo, uint4& hi) {
  const uint32_t in[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t pair[2];
    e4m3x4_to_half2x2(in[j], pair[0], pair[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) out[2 * j + h] = scaled_pair(pair[h], s);
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

// A multiplying warp's 16 rows of a 64 x BN product (acc: the wgmma fragment, thread (warp, lane)
// holding rows 16 warp + lane / 4 (+8), columns 8 j + 2 (lane % 4) (+1)) to y [., N] in bf16: rows
// row0.. before `end`, columns n0.. before N, staged through `stage` (kEpilogue's 16 rows).
template <int BN>
__device__ __forceinline__ void write_rows(const float (&acc)[BN / 2], unsigned char* stage, int row0, int end,
                                           __nv_bfloat16* y, int N, int n0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c0 = 0; c0 < BN; c0 += 64) {
    if (n0 + c0 >= N) continue;  // (a wide tile's last 128 columns past the output)
#pragma unroll
    for (int j = c0 / 8; j < c0 / 8 + 8; ++j) {
      unsigned char* at = stage + (lane / 4) * kEpiloguePitch + (8 * j - c0 + 2 * (lane % 4)) * 2;
      *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<__nv_bfloat162*>(at + 8 * kEpiloguePitch) =
          __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // rows 4 i + lane / 8, their 16 bytes lane % 8
      const int r = 4 * i + lane / 8, row = row0 + r;
      const uint4 v = *reinterpret_cast<const uint4*>(stage + r * kEpiloguePitch + lane % 8 * 16);
      if (row < end) *reinterpret_cast<uint4*>(y + int64_t(row) * N + n0 + c0 + lane % 8 * 8) = v;
    }
    __syncwarp();
  }
}

// A copying thread's weights of one step: kPieces 16-byte pieces, and the scales of the tile's
// halves (its 128 output columns 128 h..: one scale block each; pieces 4 h.. lie there).
template <class S>
struct Pieces {
  uint4 v[S::kPieces];
  float s[S::kHalves];
};

// Piece q (of BN * kBK / 16) of a step's weight tile: its row r and first column c within the
// tile as the FP8 bytes lie, 4 pieces (64 bytes) a row, a warp's 32 on 8 rows. Forward: the
// weight's rows n0.. (BN of them, the output columns) by its columns k0.. (kBK, the sum); stored
// K-major, row r at 128 bytes. Transposed: the weight's rows k0.. (the sum) by its columns n0..
// (the output), pieces 256 j.. on columns 64 j..; stored MN-major, blocks of 64 output columns 8 KB
// apart. Either way pieces 512 h.. lie in the tile's 128 output columns 128 h.. (one scale block),
// and 8 threads' stores meet no bank twice.
template <bool Transposed>
__device__ __forceinline__ void piece(int q, int& r, int& c) {
  r = Transposed ? q / 4 % kBK : q / 4;
  c = (q % 4 + (Transposed ? 4 * (q / 256) : 0)) * 16;
}
template <bool Transposed, int BN>
__device__ __forceinline__ int piece_offset(int r, int c) {
  return Transposed ? wgmma::sw128_offset<kBK>(r, c) : wgmma::sw128_offset<BN>(r, c);
}
// Piece i's distance from piece 0 (of a copying thread p < 128): forward, 32 i rows on; transposed,
// 32 (i % 2) rows and 64 (i / 2) columns on. In the weight's bytes (rows `in` apart), and in the
// tile's swizzled bytes (neither moves a row's place in its group of 8 or a chunk's in its 64 columns).
template <bool Transposed>
__device__ __forceinline__ int64_t piece_step(int i, int in) {
  return Transposed ? int64_t(32 * (i % 2)) * in + 64 * (i / 2) : int64_t(32 * i) * in;
}
template <bool Transposed>
__device__ __forceinline__ constexpr int piece_smem(int i) {
  return Transposed ? 32 * 128 * (i % 2) + kBK * 128 * (i / 2) : 32 * 128 * i;
}

// A persistent block (as many as the multiprocessors): tiles blockIdx.x, + gridDim.x, .. of the
// (row tile, column tile) grid, column tiles fastest, so that the blocks at work at once share a
// few row tiles of x and one expert's weight through L2. The copies run on into the next tile
// while the products write the last one out.
template <bool Transposed, class S>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_kernel(const __grid_constant__ CUtensorMap x_map, const Args a) {
#if defined(V4_HAS_WGMMA)
  constexpr int BM = S::BM, BN = S::BN;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = wgmma::sw128_aligned(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * S::kStageBytes);  // a stage's copies are in
  uint64_t* empty = full + kStages;                                               // its products are done
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      wgmma::bar_init(full + s, 129);  // the copying threads' 128 arrivals + x's TMA (its bytes landed)
      wgmma::bar_init(empty + s, 256);
    }
    wgmma::bar_init_fence();
  }
  __syncthreads();
  const int K = Transposed ? a.out : a.in, N = Transposed ? a.in : a.out, steps = K / kBK;
  const int col_tiles = (N + BN - 1) / BN, tiles = find_tile<BM>(a.offsets, a.E, -1).first * col_tiles;
  // (read through a shuffle: one value a warp, so the warpgroups' products are not serialised).
  // Every warpgroup keeps the 168 registers of the launch: the products' 128 accumulators fit
  // there, and the copies hold two steps of weights and their hoisted addresses.
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);

  if (wg == 2) {  // ---- the copies and the dequantisation
    // Thread p's piece i of a step lies piece_step(i) bytes on in the weight from its piece 0, and
    // piece_smem(i) bytes on in the stage's weight tile (both the same every step and tile).
    const int p = threadIdx.x % 128, scale_cols = a.in / kScaleBlock;
    int r0, c0;
    piece<Transposed>(p, r0, c0);
    const int lo0 = piece_offset<Transposed, BN>(r0, c0), hi0 = piece_offset<Transposed, BN>(r0, c0 + 8);
    const int64_t w_step = Transposed ? int64_t(kBK) * a.in : kBK;  // a step's move in the weight
    const int s_step = Transposed ? scale_cols : 1, s_half = Transposed ? 1 : scale_cols;  // in the scales
    // The copies walk one stream of (tile, step) pairs, so that their loads run kAhead - 1 steps
    // ahead of the conversion across a tile's end as within a tile. kAhead: the steps of weights a
    // copying thread holds in registers. Four (three loads in flight) took the same time as two on an
    // H100 (twenty-seventh session): the loads' latency does not bound the kernel.
    constexpr int kAhead = 2;
    struct Cursor {
      int t = 0, step = 0, halves = 0;
      Tile tile{};
      const uint8_t* w = nullptr;
      const float* scale = nullptr;
    };
    // Cursor c onto tile t's first step. The tile's scale blocks past the weight's last column
    // (halves..) are not read: their columns' products are never written out.
    const auto start = [&](Cursor& c, int t) {
      c.t = t;
      c.step = 0;
      if (t >= tiles) return;
      c.tile = find_tile<BM>(a.offsets, a.E, t / col_tiles);
      const int n0 = t % col_tiles * BN;
      c.halves = min(S::kHalves, (N - n0) / kScaleBlock);
      const int64_t expert = int64_t(c.tile.expert) * a.out * a.in;
      c.w = a.w + expert + (Transposed ? int64_t(r0) * a.in + n0 + c0 : int64_t(n0 + r0) * a.in + c0);
      c.scale = a.scale + expert / (kScaleBlock * kScaleBlock) + n0 / kScaleBlock * s_half;
    };
    const auto advance = [&](Cursor& c) {
      if (++c.step == steps) start(c, c.t + gridDim.x);
    };
    const auto fetch = [&](Pieces<S>& f, const Cursor& c) {
      const uint8_t* ws = c.w + c.step * w_step;
      const float* ss = c.scale + c.step * kBK / kScaleBlock * s_step;
#pragma unroll
      for (int h = 0; h < S::kHalves; ++h)
        if (h < c.halves) f.s[h] = __ldg(ss + h * s_half);
#pragma unroll
      for (int i = 0; i < S::kPieces; ++i)
        if (i / 4 < c.halves) f.v[i] = __ldg(reinterpret_cast<const uint4*>(ws + piece_step<Transposed>(i, a.in)));
    };
    int it = 0;  // steps so far, over every tile: the ring's position and phase
    const auto put = [&](const Pieces<S>& f, const Cursor& c) {
      const int slot = it % kStages, step = c.step;
      wgmma::bar_wait(empty + slot, ((it / kStages) & 1) ^ 1);
      ++it;
      unsigned char* x_tile = smem + slot * S::kStageBytes;
      if (p == 0) {  // x's rows first.. (past the expert's last: the next one's, or zeros), by TMA
        wgmma::bar_arrive_expect(full + slot, S::kXTile);
        wgmma::tma_load_2d(x_tile, &x_map, step * kBK, c.tile.first, full + slot);
      }
      unsigned char* w_tile = x_tile + S::kXTile;
#pragma unroll
      for (int i = 0; i < S::kPieces; ++i) {
        uint4 lo, hi;
        dequantize16(f.v[i], f.s[i / 4], lo, hi);
        *reinterpret_cast<uint4*>(w_tile + lo0 + piece_smem<Transposed>(i)) = lo;
        *reinterpret_cast<uint4*>(w_tile + hi0 + piece_smem<Transposed>(i)) = hi;
      }
      wgmma::fence_shared();  // the stores, seen by the products' reads
      wgmma::bar_arrive(full + slot);
    };
    // Step n's weights in f[n % kAhead], loaded when step n - kAhead + 1 is converted. Set once: the
    // pieces a tile leaves unread feed only its columns past N.
    Pieces<S> f[kAhead] = {};
    Cursor load, conv;
    start(load, blockIdx.x);
    start(conv, blockIdx.x);
#pragma unroll
    for (int j = 0; j + 1 < kAhead; ++j)
      if (load.t < tiles) {
        fetch(f[j], load);
        advance(load);
      }
    while (conv.t < tiles) {
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        if (conv.t >= tiles) break;
        if (load.t < tiles) {
          fetch(f[(j + kAhead - 1) % kAhead], load);
          advance(load);
        }
        put(f[j], conv);
        advance(conv);
      }
    }
    return;
  }

  // ---- the products: warpgroup wg, x's rows BM / 2 wg.. of the tile (kSub products of 64), all
  // BN columns
  const uint32_t base = wgmma::saddr(smem);
  const int warp = (threadIdx.x / 32) % 4;
  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tile = find_tile<BM>(a.offsets, a.E, t / col_tiles);
    const int n0 = t % col_tiles * BN;
    float acc[S::kSub][BN / 2];
#pragma unroll
    for (int u = 0; u < S::kSub; ++u)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[u][i] = 0.0f;
    for (int step = 0; step < steps; ++step, ++it) {
      const int slot = it % kStages;
      wgmma::bar_wait(full + slot, (it / kStages) & 1);
      wgmma::fence_shared();
      const uint32_t x_tile = base + slot * S::kStageBytes + wg * (S::kXTile / 2),
                     w_tile = base + slot * S::kStageBytes + S::kXTile;
#pragma unroll
      for (int u = 0; u < S::kSub; ++u) wgmma::fence_operand(acc[u]);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t w_desc = Transposed ? wgmma::desc128(w_tile + kk * 2048, kBK * 128, 1024)
                                           : wgmma::desc128(w_tile + wgmma::sw128_k_step<BN>(kk), 16, 1024);
#pragma unroll
        for (int u = 0; u < S::kSub; ++u)  // rows 64 u.. of this warpgroup's, 8 KB apart
          wgmma::mma<__nv_bfloat16, BN, 0, Transposed ? 1 : 0>(
              acc[u], wgmma::desc128(x_tile + u * 8192 + wgmma::sw128_k_step<BM>(kk), 16, 1024), w_desc);
      }
      wgmma::commit();
      wgmma::wait<1>();  // the step before is done with its stage
#pragma unroll
      for (int u = 0; u < S::kSub; ++u) wgmma::fence_operand(acc[u]);
      if (step > 0) wgmma::bar_arrive(empty + (it - 1) % kStages);
    }
    wgmma::wait<0>();
#pragma unroll
    for (int u = 0; u < S::kSub; ++u) wgmma::fence_operand(acc[u]);
    wgmma::bar_arrive(empty + (it - 1) % kStages);
    unsigned char* stage = smem + kStages * S::kStageBytes + 128 + (4 * wg + warp) * 16 * kEpiloguePitch;
#pragma unroll
    for (int u = 0; u < S::kSub; ++u)
      write_rows<BN>(acc[u], stage, tile.first + BM / 2 * wg + 64 * u + 16 * warp, tile.end, a.y, N, n0);
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// ---- The mixed-input design (both ways unless V4TRAIN_FP8_GROUPED_VARIANTS=staged): the weight is
// the product's A operand taken from registers, turned from FP8 by the multiplying warps themselves,
// and x the B operand from shared memory ("swap AB": a block computes y^T's tile, its rows 128 output
// features, the weight's rows, its columns BT tokens, x's rows of one expert). A producer warp has x's
// bf16 tile and the weight's raw FP8 tile copied by TMA into a ring of stages; no warp stores a
// converted tile. Each multiplying thread reads its A fragment's 16 bytes of a step from the FP8 tile,
// turns each pair into bf16 exactly as dequantize16 does (float(w) * scale in fp32, rounded once), and
// issues m64nBTk16 with A in four registers, converting the next 16 columns while the product before
// runs. Per 64-wide step of a 128 x 256 tile, shared memory carries x's copy (32 KB) and the weight's
// (8 KB), the two warpgroups' reads of x's tile (2 x 32 KB) and the fragments' 2-byte loads (128
// wavefronts of 64 useful bytes: 16 KB of the pipe's time), ~120 KB against fp8_grouped_kernel's
// ~144 KB (its products read the weight tile twice a warpgroup and x once, 96 KB, and the copies
// store 16 KB of bf16 besides x's 32 KB). The same bf16 operands and fp32 sums in the same order of
// 16-column products: y equals fp8_grouped_kernel's bit for bit (its CUDA test asserts it).
// Transposed (the backward): dx^T = W_e^T dy^T, A the
// weight's tile turned (M the in features, K out), B dy's tile as x's. The weight's tile comes as it lies,
// 64 rows of out by 128 bytes of in (the 128-byte swizzle), M-contiguous, so a fragment's pairs (two k
// of a row) are not adjacent bytes: ldmatrix .trans over the tile as 16-bit pairs gives lane 4 g + t the
// bytes (k 2t, m 2g), (2t, 2g + 1), (2t + 1, 2g), (2t + 1, 2g + 1) of an 8 x 16-byte block, and one byte
// permute makes them k pairs of rows 2g and 2g + 1 (FlashAttention-3's FP8 V). These are the fragment's
// rows g and g + 8: its rows are the 16 features of the warp in the order 0, 2, .., 14, 1, 3, .., 15,
// which the epilogue undoes (features are the product's M, so nothing else moves).
constexpr int kRsRows = 128;  // a tile's output features: two warpgroups of 64 (one scale block)

template <int BT_>
struct Rs {
  static constexpr int BT = BT_;  // tokens a tile: the product's N
  static constexpr int kXTile = BT * kBK * 2;  // x's rows: BT of 64 bf16, 128-byte swizzle
  // The weight's: 128 rows of 64 FP8 bytes, 64-byte swizzle (transposed: 64 x 128, 128-byte).
  static constexpr int kWTile = kRsRows * kBK;
  static constexpr int kStageBytes = kXTile + kWTile;
  static constexpr int kStages = BT == 256 ? 5 : 8;
  // The epilogue: each warpgroup stages 32 tokens x its 64 features at a time (144 bytes a token: the
  // 8 rows of a transposed store, and 4 rows read 128 bytes each, meet every bank the fewest times), in
  // two buffers, so that one barrier a chunk orders its stores after the reads of the chunk before.
  static constexpr int kChunk = 32, kPitch = 144, kChunkBytes = kChunk * kPitch;
  static constexpr int kBarriers = 256;  // full, empty (8 bytes a stage each), the stages' scales (4 each)
  static constexpr size_t kSmem = size_t(kStages) * kStageBytes + kBarriers + 2 * 2 * kChunkBytes + 1024;
  static_assert(kStages * 20 <= kBarriers && kSmem <= 232448 && BT / kChunk % 2 == 0, "fp8_registers: the carve");
};

// Two e4m3 weights (columns k, k + 1 of a row: v's low 16 bits, k's the low byte) times s in fp32, each
// rounded once to bf16: a bf16 pair, k's low (dequantize16's arithmetic, value for value). (v a 32-bit
// register: 16-bit ones cost a byte permute each to pack.)
[[maybe_unused]] __device__ __forceinline__ uint32_t dequantize2(uint32_t v, float s) {
  uint32_t h;
  asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(h) : "r"(v));
  return scaled_pair(h, s);
}

// Four 8 x 8 matrices of 16-bit pairs, each stored transposed (stmatrix .trans): register i holds
// matrix i as an mma fragment (lane l: row l / 4, columns 2 (l % 4), +1); lane 8 i + r names where
// row r of its transpose (the matrix's column r) goes, 16 bytes.
[[maybe_unused]] __device__ __forceinline__ void stmatrix_trans4(uint32_t addr, uint32_t r0, uint32_t r1,
                                                                 uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// A persistent block as fp8_grouped_kernel's, the same order of tiles (feature tiles fastest). Warpgroups
// 0 and 1 multiply (features 64 wg.. of the tile); in warpgroup 2 one thread asks for the copies and the
// rest give their registers up. Transposed: the backward (the design's note above).
template <bool Transposed, int BT>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_registers_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                         const Args a) {
#if defined(V4_HAS_WGMMA)
  using S = Rs<BT>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = wgmma::sw128_aligned(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kStages * S::kStageBytes);  // a stage's copies landed
  uint64_t* empty = full + S::kStages;                                                // its products are done
  float* scales = reinterpret_cast<float*>(empty + S::kStages);  // a stage's weight scale (one block)
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      wgmma::bar_init(full + s, 1);   // the producer's arrival (after the scale's store) + the copies' bytes
      wgmma::bar_init(empty + s, 8);  // lane 0 of each multiplying warp
    }
    wgmma::bar_init_fence();
  }
  __syncthreads();
  // K: the sum (in, or transposed out); N: y's columns, the features (out, or in).
  const int K = Transposed ? a.out : a.in, N = Transposed ? a.in : a.out;
  const int steps = K / kBK, col_tiles = N / kRsRows;
  const int tiles = find_tile<BT>(a.offsets, a.E, -1).first * col_tiles;
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  const int lane = threadIdx.x % 32;

  if (wg == 2) {  // ---- the copies: warp 0 walks the tiles (find_tile takes a warp), its lane 0 asks
    wgmma::regs_shrink<40>();
    if (threadIdx.x % 128 >= 32) return;
    const int blocks_in = a.in / kScaleBlock;
    int it = 0;  // steps so far, over every tile: the ring's position and phase
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const Tile tile = find_tile<BT>(a.offsets, a.E, t / col_tiles);
      const int f0 = t % col_tiles * kRsRows, w_row = tile.expert * a.out + (Transposed ? 0 : f0);
      // The scale block of (out rows, in columns): forward (f0, the step's), transposed (the step's, f0).
      const float* scale =
          a.scale + (int64_t(tile.expert) * (a.out / kScaleBlock) + (Transposed ? 0 : f0 / kScaleBlock)) * blocks_in +
          (Transposed ? f0 / kScaleBlock : 0);
      const int s_step = Transposed ? blocks_in : 1;
      for (int step = 0; step < steps; ++step, ++it) {
        if (lane != 0) continue;
        const int slot = it % S::kStages;
        const float s = __ldg(scale + step * kBK / kScaleBlock * s_step);  // (its trip to L2 under the wait)
        wgmma::bar_wait(empty + slot, ((it / S::kStages) & 1) ^ 1);
        scales[slot] = s;  // (seen by the products through full's arrival: release, acquire)
        unsigned char* stage = smem + slot * S::kStageBytes;
        // x's rows first.. (past the expert's last: the next one's, or zeros); the weight's rows f0.. of
        // the expert, columns step * 64.., or transposed its rows step * 64.., columns f0..
        wgmma::bar_arrive_expect(full + slot, S::kStageBytes);
        wgmma::tma_load_2d(stage, &x_map, step * kBK, tile.first, full + slot);
        if (Transposed) wgmma::tma_load_2d(stage + S::kXTile, &w_map, f0, w_row + step * kBK, full + slot);
        else wgmma::tma_load_2d(stage + S::kXTile, &w_map, step * kBK, w_row, full + slot);
      }
    }
    return;
  }

  // ---- the products: warpgroup wg, the tile's features 64 wg.. (A), all BT tokens (B)
  wgmma::regs_grow<232>();
  const int warp = (threadIdx.x / 32) % 4;
  // This thread's A fragment of a 16-column slice kk (mma_rs: rows row0 = 64 wg + 16 warp + lane / 4
  // (+8), columns 2 (lane % 4) (+1) (+8)) lies in the stage's FP8 tile (row r at 64 r, its 16-byte
  // chunk kk at kk ^ (r / 2) % 4: (row0 / 2) % 4 = lane / 8, and the same for row0 + 8) as four
  // 2-byte pairs at chunk[kk] + frag[i]: a[0] (row0, col), a[1] (row0 + 8, col), a[2] (row0, col + 8),
  // a[3] (row0 + 8, col + 8). A warp's 32 loads of one of them read 16 words on 16 banks (lanes 2 j,
  // 2 j + 1 share one): one wavefront (tools/fp8_registers_check.py).
  const int row0 = 64 * wg + 16 * warp + lane / 4;
  int chunk[4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) chunk[kk] = S::kXTile + row0 * kBK + ((kk ^ (lane / 8)) * 16) + 2 * (lane % 4);
  constexpr int frag[4] = {0, 8 * kBK, 8, 8 * kBK + 8};
  // Transposed: the tile's row k (of out) at 128 k, its 16-byte chunk c (bytes 16 c.. of in) at c ^ k % 8. A
  // step's fragments are 8 ldmatrix matrices, two .x4: matrix i of load q is rows 32 q + 8 i.. (slice
  // 2 q + i / 2, its k 8 (i % 2)..), the warp's 16 features (chunk 4 wg + warp): lane l names row 32 q + l.
  // Each matrix's 8 rows of 16 bytes meet every bank once (tools/fp8_registers_check.py).
  const uint32_t ld_at = wgmma::saddr(smem) + S::kXTile + lane * 128 + (((4 * wg + warp) ^ (lane % 8)) * 16);
  const uint64_t x_desc = wgmma::desc128(wgmma::saddr(smem), 16, 1024);  // stage 0's x, K-major, 16 columns 32 bytes
  // The epilogue's buffers: this warpgroup's two, and where lane l's row of a transposed store goes
  // (matrix l / 8: tokens 8 (l / 16).. of a pair of 8-token groups, features 16 warp + 8 (l / 8 % 2)..).
  unsigned char* const epilogue = smem + S::kStages * S::kStageBytes + S::kBarriers + wg * 2 * S::kChunkBytes;
  const uint32_t st_at =
      wgmma::saddr(epilogue) + (8 * (lane / 16) + lane % 8) * S::kPitch + (16 * warp + 8 * (lane / 8 % 2)) * 2;
  const int p = threadIdx.x % 128;  // the copy out: token p / 8 (+16), its 16 bytes p % 8

  // A step's fragment bytes (slice kk, register i): 2 a register, or transposed 4 (k pairs of two rows).
  constexpr int kRaw = Transposed ? 2 : 4;
  uint32_t raw[4][kRaw];
  uint32_t af[2][4];   // the fragments of two slices: one in a product, the next converted
  float scale = 0.0f;
  // Step `it`'s stage, once landed: its scale and this thread's bytes.
  const auto load = [&](int n) {
    const int slot = n % S::kStages;
    wgmma::bar_wait(full + slot, (n / S::kStages) & 1);
    scale = scales[slot];
    if constexpr (Transposed) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // (mma_sync.cuh's ldmatrix .trans, matrices 2 q.. as slices 2 q, 2 q + 1)
        uint32_t mat[4];
        ldsm_x4_t(mat, ld_at + slot * S::kStageBytes + q * 32 * 128);
        raw[2 * q][0] = mat[0];
        raw[2 * q][1] = mat[1];
        raw[2 * q + 1][0] = mat[2];
        raw[2 * q + 1][1] = mat[3];
      }
    } else {
      const unsigned char* stage = smem + slot * S::kStageBytes;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) raw[kk][i] = *reinterpret_cast<const uint16_t*>(stage + chunk[kk] + frag[i]);
    }
  };
  const auto convert = [&](uint32_t (&f)[4], const uint32_t (&r)[kRaw]) {
    if constexpr (Transposed) {
      // r[h]: bytes (k, m), (k, m + 1), (k + 1, m), (k + 1, m + 1), k = 8 h + 2 (lane % 4), m = 2 (lane / 4);
      // permuted to (k, m), (k + 1, m), (k, m + 1), (k + 1, m + 1): fragment rows g (feature m), g + 8 (m + 1).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t lo, hi;
        e4m3x4_to_half2x2(__byte_perm(r[h], 0, 0x3120), lo, hi);
        f[2 * h] = scaled_pair(lo, scale);
        f[2 * h + 1] = scaled_pair(hi, scale);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) f[i] = dequantize2(r[i], scale);
    }
  };
  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tile = find_tile<BT>(a.offsets, a.E, t / col_tiles);
    const int f0 = t % col_tiles * kRsRows;
    float acc[BT / 2];
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) acc[i] = 0.0f;
    load(it);
    convert(af[0], raw[0]);
    for (int step = 0; step < steps; ++step, ++it) {
      const uint32_t stage = (it % S::kStages) * S::kStageBytes;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma::fence_operand(acc);
        wgmma::fence();  // (af written by this thread since the last product)
        wgmma::mma_rs<__nv_bfloat16, 0, BT>(acc, af[kk % 2], wgmma::desc_add(x_desc, stage + 32 * kk));
        wgmma::commit();
        wgmma::wait<1>();  // the product before done: its fragment free, and at kk 0 the step before's stage
        wgmma::fence_operand(acc);
        if (kk == 0 && step > 0) {
          __syncwarp();
          if (lane == 0) wgmma::bar_arrive(empty + (it - 1) % S::kStages);
        }
        if (kk < 3) {
          convert(af[(kk + 1) % 2], raw[kk + 1]);
        } else if (step + 1 < steps) {  // the next step's first slice, while this one's last runs
          load(it + 1);
          convert(af[0], raw[0]);
        }
      }
    }
    wgmma::wait<0>();
    wgmma::fence_operand(acc);
    __syncwarp();
    if (lane == 0) wgmma::bar_arrive(empty + (it - 1) % S::kStages);
    // y^T's fragment (features 16 warp + lane / 4 (+8), tokens 8 j + 2 (lane % 4) (+1)) to y [token,
    // feature]: 32 tokens at a time, 8 x 8 blocks stored transposed into the warpgroup's buffer (token
    // rows of its 64 features), then each token's 128 bytes copied out whole, rows past the expert's end
    // not written.
#pragma unroll
    for (int c = 0; c < BT / S::kChunk; ++c) {  // (an even count: chunk c in buffer c % 2 in every tile)
      const int buffer = (c % 2) * S::kChunkBytes;
      if constexpr (Transposed) {
        // Fragment rows g, g + 8 are features 2 g, 2 g + 1: a thread holds both of tokens 8 j + 2 (lane % 4)
        // (+1), one 4-byte word a token (a register's 32 words meet every bank once at the pitch of 144).
#pragma unroll
        for (int j = 4 * c; j < 4 * c + 4; ++j) {
          unsigned char* at = epilogue + buffer + (8 * j - S::kChunk * c + 2 * (lane % 4)) * S::kPitch +
                              (16 * warp + 2 * (lane / 4)) * 2;
          *reinterpret_cast<uint32_t*>(at) = pack_bf16(acc[4 * j], acc[4 * j + 2]);
          *reinterpret_cast<uint32_t*>(at + S::kPitch) = pack_bf16(acc[4 * j + 1], acc[4 * j + 3]);
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // tokens 32 c + 16 h..: groups j, j + 1
          const int j = 4 * c + 2 * h;
          stmatrix_trans4(st_at + buffer + 16 * h * S::kPitch, pack_bf16(acc[4 * j], acc[4 * j + 1]),
                          pack_bf16(acc[4 * j + 2], acc[4 * j + 3]), pack_bf16(acc[4 * j + 4], acc[4 * j + 5]),
                          pack_bf16(acc[4 * j + 6], acc[4 * j + 7]));
        }
      }
      wgmma::named_sync(1 + wg, 128);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int r = p / 8 + 16 * u, row = tile.first + S::kChunk * c + r;
        const uint4 v = *reinterpret_cast<const uint4*>(epilogue + buffer + r * S::kPitch + p % 8 * 16);
        if (row < tile.end)
          *reinterpret_cast<uint4*>(a.y + int64_t(row) * N + f0 + 64 * wg + p % 8 * 8) = v;
      }
    }
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// ---- The products on FP8 tensor cores (fp8_tensor_cores() names experts, lora.h): x quantised
// per row per 128 columns (fp8.cuh's quantize_rows) times the FP8 weight as it lies, DeepGEMM's
// design. Tiles of 128 x 128; a step of the sum is one 128-column scale block (128 bytes a row,
// one swizzled row), its four e4m3 products (m64n128k32) summed on the tensor cores, then added to
// fp32 accumulators times the row's and the weight block's scales (path (a)'s arithmetic, whose
// bound parity/fp8_bound.py derives). 8-bit operands must be K-major. Forward, the weight's rows
// (out: the product's columns) by in (the sum) are that already, and both tiles come by TMA.
// Backward, the weight's tile of 128 rows of out (the sum) by 128 of in (the columns) comes as it
// lies, and warpgroup 2 transposes it in shared memory (transpose_tile) a few steps behind the
// copies it asks for, so that they run ahead of it.
constexpr int kT = 128;                // the tile's rows, columns, and a step of the sum
constexpr int kTileBytes = kT * kT;    // 16 KB: 128 rows of 128 FP8 values
constexpr int kE4m3Stages = 4;
constexpr int kE4m3Offsets = 1024;  // the experts' row ends that shared memory holds (find_tile's loads)

// BN: the tile's columns, 128 or (forward) 256: an x tile's copies serve twice the products, where
// 128 x 128 tiles ask the L2 for 32 KB a step of 4.2 MFLOP.
template <bool Transposed, int BN = kT>
struct E4m3 {
  static_assert(BN == kT || (BN == 2 * kT && !Transposed), "e4m3 tiles: 128 x 128 both ways, 128 x 256 forward");
  static constexpr int kHalves = BN / kT;  // the weight's scale blocks across the tile's columns
  // A stage: x's tile, the weight's tile as the products read it, and backward the tile as it lies.
  static constexpr int kStageBytes = (1 + kHalves + (Transposed ? 1 : 0)) * kTileBytes;
  // After the ring: its barriers (96 bytes), then each multiplying warp's staging rows (kEpilogue).
  static constexpr size_t kSmem =
      size_t(kE4m3Stages) * kStageBytes + 128 + kEpilogueBytes + kE4m3Offsets * sizeof(int) + 1024;
};

// x and the weight come as TMA maps of bytes (wgmma::tensor_map_swizzled: boxes of 128 x 128): x
// quantised [padded, K], the weight [E out, in].
struct E4m3Args {
  const float* x_scale;  // [K / 128, padded]: quantize_rows' scales, x's row r in block b at b padded + r
  const float* w_scale;  // [E, out / 128, in / 128]
  const int* offsets;    // [first + E]: the end of each expert's rows
  __nv_bfloat16* y;      // [rows, N]
  int E, out, in, padded;
  int first;  // the experts are first.. of offsets' (a group of them: transpose_global)
};

// The backward's weight tile turned K-major. `raw` holds the weight's rows k0.. (the sum) by its
// columns n0.. (bytes: the output) as TMA copied them, with the 128-byte swizzle (row r's 16-byte
// chunk c at chunk c ^ r % 8); `tile` gets row n, bytes k, in the same swizzle, as the products read
// a K-major operand. Thread t moves eight blocks of 4 x 4 bytes, four 32-bit words in and four out
// (byte permutes between them): block (kb, nb) is rows 4 kb.. of raw, columns 4 nb..; lane l takes
// nb = l, kb = h(l) ^ (8 warp + i), so that the warps cover the 32 x 32 blocks once and a warp's 32
// loads of a row, and its 32 stores, meet 32 different banks (tools/fp8_transpose_check.py).
[[maybe_unused]] __device__ __forceinline__ void transpose_tile(const unsigned char* raw, unsigned char* tile, int t) {
  const int warp = t / 32, nb = t % 32;
  const int h = (nb >> 2 & 3) | (nb >> 1 & 1) << 2 | (nb >> 4 & 1) << 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int kb = h ^ (8 * warp + i);
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // byte b of w[j]: raw (4 kb + j, 4 nb + b)
      const int r = 4 * kb + j;
      w[j] = *reinterpret_cast<const uint32_t*>(raw + r * 128 + ((nb / 4) ^ (r % 8)) * 16 + nb % 4 * 4);
    }
    const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), lo23 = __byte_perm(w[2], w[3], 0x5140);
    const uint32_t hi01 = __byte_perm(w[0], w[1], 0x7362), hi23 = __byte_perm(w[2], w[3], 0x7362);
    const uint32_t o[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                           __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
    for (int b = 0; b < 4; ++b) {  // byte j of o[b]: raw (4 kb + j, 4 nb + b), at tile (4 nb + b, 4 kb + j)
      const int n = 4 * nb + b;
      *reinterpret_cast<uint32_t*>(tile + n * 128 + ((kb / 4) ^ (n % 8)) * 16 + kb % 4 * 4) = o[b];
    }
  }
}

// The backward's weight turned once in global memory, [E, out, in] bytes into [E, in, out]: a block a
// 128 x 128 tile through shared memory in transpose_tile's swizzled layout both ways, 16-byte rows'
// chunks in and out (tools/fp8_transpose_check.py mirrors the indices). Then the backward's products
// take it by TMA as the forward's do, where the transposition in the kernel shares warpgroup 2 and
// shared memory's bandwidth with the products.
__global__ void __launch_bounds__(128) transpose_fp8_kernel(const uint8_t* w, uint8_t* wt, int rows, int cols) {
  __shared__ __align__(128) unsigned char raw[kTileBytes], tile[kTileBytes];
  const int t = threadIdx.x, r0 = blockIdx.y * kT, c0 = blockIdx.x * kT;
  const int64_t e = int64_t(blockIdx.z) * rows * cols;
#pragma unroll
  for (int j = 0; j < kTileBytes / 16 / 128; ++j) {  // row r's chunk c at chunk c ^ r % 8
    const int r = (t + 128 * j) / 8, c = t % 8;
    *reinterpret_cast<uint4*>(raw + r * 128 + (c ^ r % 8) * 16) =
        __ldg(reinterpret_cast<const uint4*>(w + e + int64_t(r0 + r) * cols + c0 + 16 * c));
  }
  __syncthreads();
  transpose_tile(raw, tile, t);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kTileBytes / 16 / 128; ++j) {  // the tile's row n: the weight's column c0 + n
    const int n = (t + 128 * j) / 8, c = t % 8;
    *reinterpret_cast<uint4*>(wt + e + int64_t(c0 + n) * rows + r0 + 16 * c) =
        *reinterpret_cast<const uint4*>(tile + n * 128 + (c ^ n % 8) * 16);
  }
}

// A persistent block as fp8_grouped_kernel's, the same order of tiles. 128 x 256 tiles hold 128
// accumulators and 64 of a block's sums a multiplying thread: warpgroup 2 gives registers up.
template <bool Transposed, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_e4m3_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                    const E4m3Args a) {
#if defined(V4_HAS_WGMMA)
  using S = E4m3<Transposed, BN>;
  constexpr int kHalves = S::kHalves;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = wgmma::sw128_aligned(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kE4m3Stages * S::kStageBytes);  // the stage's tiles are in
  uint64_t* empty = full + kE4m3Stages;   // its products are done
  uint64_t* copied = empty + kE4m3Stages;  // backward: the weight's tile as it lies has landed
  if (threadIdx.x == 0) {
    for (int s = 0; s < kE4m3Stages; ++s) {
      wgmma::bar_init(full + s, Transposed ? 129 : 1);  // the copies (+ backward the 128 transposing threads)
      wgmma::bar_init(empty + s, 8);                     // lane 0 of each multiplying warp
      wgmma::bar_init(copied + s, 1);
    }
    wgmma::bar_init_fence();
  }
  // The experts' row ends in shared memory where they fit: find_tile at each tile's start, in every
  // warp, was a round trip through an L2 busy with the copies before the tile's first product.
  int* const offsets_smem = reinterpret_cast<int*>(smem + kE4m3Stages * S::kStageBytes + 128 + kEpilogueBytes);
  const bool offsets_fit = a.first + a.E <= kE4m3Offsets;
  if (offsets_fit)
    for (int i = threadIdx.x; i < a.first + a.E; i += blockDim.x) offsets_smem[i] = __ldg(a.offsets + i);
  const int* const offsets = offsets_fit ? offsets_smem : a.offsets;
  __syncthreads();
  const int K = Transposed ? a.out : a.in, N = Transposed ? a.in : a.out, steps = K / kT;
  const int col_tiles = (N + BN - 1) / BN, tiles = find_tile<kT>(offsets, a.E, -1, a.first).first * col_tiles;
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);

  if (wg == 2) {  // ---- the copies (thread 0) and, backward, the transposition (all 128)
    if constexpr (kHalves == 2) wgmma::regs_shrink<56>();
    const int p = threadIdx.x % 128;
    // Backward: step it - kLag's tile is transposed before step it's copies are asked for, with up to
    // three steps' copies in flight (a model check of the barriers: deadlock-free up to a lag of 4
    // with the ring of 4 stages; 3 keeps the most copies in flight where they are slow).
    constexpr int kLag = 3;
    const auto transpose = [&](int j) {  // step j's weight tile, once it landed
      const int slot = j % kE4m3Stages;
      wgmma::bar_wait(copied + slot, (j / kE4m3Stages) & 1);
      unsigned char* stage = smem + slot * S::kStageBytes;
      transpose_tile(stage + 2 * kTileBytes, stage + kTileBytes, p);
      wgmma::fence_shared();  // the stores, seen by the products' reads
      wgmma::bar_arrive(full + slot);
    };
    int it = 0;  // steps so far, over every tile: the ring's position and phase
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const Tile tile = find_tile<kT>(offsets, a.E, t / col_tiles, a.first);
      const int n0 = t % col_tiles * BN;
      for (int step = 0; step < steps; ++step, ++it) {
        // (first: it needs only copies asked for before, so the thread issuing them never holds it up)
        if (Transposed && it >= kLag) transpose(it - kLag);
        if (p == 0) {
          const int slot = it % kE4m3Stages;
          wgmma::bar_wait(empty + slot, ((it / kE4m3Stages) & 1) ^ 1);
          unsigned char* stage = smem + slot * S::kStageBytes;
          // x's rows first.. (past the expert's last: the next one's, or zeros); the weight's tile:
          // forward rows n0.. of the expert's out by columns step.. of in, backward rows step.. by n0..
          const int w_row = tile.expert * a.out + (Transposed ? step * kT : n0), w_col = Transposed ? n0 : step * kT;
          wgmma::bar_arrive_expect(full + slot, (Transposed ? 1 : 1 + kHalves) * kTileBytes);
          wgmma::tma_load_2d(stage, &x_map, step * kT, tile.first, full + slot);
          if (Transposed) {
            wgmma::bar_arrive_expect(copied + slot, kTileBytes);
            wgmma::tma_load_2d(stage + 2 * kTileBytes, &w_map, w_col, w_row, copied + slot);
          } else {
            wgmma::tma_load_2d(stage + kTileBytes, &w_map, w_col, w_row, full + slot);
          }
        }
      }
    }
    if (Transposed)
      for (int j = max(it - kLag, 0); j < it; ++j) transpose(j);
    return;
  }

  // ---- the products: warpgroup wg, rows 64 wg.. of the tile, all BN columns
  if constexpr (kHalves == 2) wgmma::regs_grow<224>();
  // Stage 0's descriptors, this warpgroup's 64 rows of x and the weight's first half: every product's
  // is one of these moved on (desc_add).
  const uint64_t x_desc = wgmma::desc128(wgmma::saddr(smem) + wg * (kTileBytes / 2), 16, 1024),
                 w_desc = wgmma::desc128(wgmma::saddr(smem) + kTileBytes, 16, 1024);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int blocks_in = a.in / kT;
  // Tile t: its rows, first column, halves within N, and scales: this thread's rows' of x (its
  // rows past x's padding read the last row's: they are not written out) and the weight's, a step
  // apart by w_step.
  struct Place {
    Tile tile;
    int n0, halves;
    const float *x0, *x1, *w;
  };
  const auto place_of = [&](int t) {
    const Tile tile = find_tile<kT>(offsets, a.E, t / col_tiles, a.first);
    const int n0 = t % col_tiles * BN, row = tile.first + 64 * wg + 16 * warp + lane / 4;
    return Place{tile, n0, min(BN, N - n0) / kT,  // (a wide tile past N: one half)
                 a.x_scale + min(row, a.padded - 1), a.x_scale + min(row + 8, a.padded - 1),
                 a.w_scale + (int64_t(tile.expert) * (a.out / kT) + (Transposed ? 0 : n0 / kT)) * blocks_in +
                     (Transposed ? n0 / kT : 0)};
  };
  const int w_step = Transposed ? blocks_in : 1;
  // A step's scales (half h's weight block: the next block row), loaded a step ahead, the first
  // step's of the next tile during this tile's last: loaded at the step's start, their round trip
  // through an L2 busy with the copies outlasted the wait for the stage, and both warpgroups waited
  // on them (a helper's reading of the ncu run, 2026-12-06).
  const auto load_scales = [&](const Place& c, int step, float (&w)[kHalves], float& x0, float& x1) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) w[h] = h < c.halves ? __ldg(c.w + step * w_step + h * blocks_in) : 0.0f;
    x0 = __ldg(c.x0 + int64_t(step) * a.padded);
    x1 = __ldg(c.x1 + int64_t(step) * a.padded);
  };
  // The multiplying warps spend 44% of their samples in the wait for their own products (ncu,
  // 2026-12-06): both warpgroups issue, wait and promote at once. Taking turns by half-steps on named
  // barriers (CUTLASS's ping-pong schedule; the twenty-fourth session's variant `pingpong`) gave the
  // same bits but 5.64 ms against 4.96 for the MoE op's ten launches (H100): removed.
  float sw[kHalves] = {}, s0 = 0.0f, s1 = 0.0f;
  Place now{};
  if (int(blockIdx.x) < tiles) {
    now = place_of(blockIdx.x);
    load_scales(now, 0, sw, s0, s1);
  }
  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tile = now.tile;
    const int n0 = now.n0, halves = now.halves;
    const bool more = t + int(gridDim.x) < tiles;
    const Place next = more ? place_of(t + gridDim.x) : Place{};
    // acc: half h's fragment (columns n0 + 128 h..) at 64 h.., a 64 x BN fragment as write_rows reads it.
    float acc[BN / 2], part[64];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    for (int step = 0; step < steps; ++step, ++it) {
      const int slot = it % kE4m3Stages;
      float next_sw[kHalves] = {}, next_s0 = 0.0f, next_s1 = 0.0f;
      if (step + 1 < steps) load_scales(now, step + 1, next_sw, next_s0, next_s1);
      else if (more) load_scales(next, 0, next_sw, next_s0, next_s1);
      wgmma::bar_wait(full + slot, (it / kE4m3Stages) & 1);
      const uint32_t stage = slot * S::kStageBytes;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        if (h >= halves) break;
        wgmma::fence_operand(part);
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < kT / 32; ++kk)
          wgmma::mma_e4m3(part, wgmma::desc_add(x_desc, stage + 32 * kk),
                          wgmma::desc_add(w_desc, stage + h * kTileBytes + 32 * kk), kk > 0);
        wgmma::commit();
        // The block's sums promoted: one fp32 rounding of the scales' product, one of each fused add.
        // (ptxas moves the weight's scale into a uniform register right after its load, a step early,
        // and waits there on the load: ~4,200 long-scoreboard samples of ~130,000 in ncu. An empty asm
        // on its use, which emits nothing that ptxas sees, did not stop it. DeepGEMM reads its weight
        // scales from shared memory, where a tile's are put at its start: the next thing to try.)
        const float r0 = s0 * sw[h], r1 = s1 * sw[h];
        wgmma::wait<0>();
        wgmma::fence_operand(part);
        if (h == halves - 1) {  // the warp's reads of the stage done: one arrival for its 32 lanes
          __syncwarp();
          if (lane == 0) wgmma::bar_arrive(empty + slot);
        }
        float* acc_h = acc + 64 * h;
#pragma unroll
        for (int j = 0; j < 16; ++j) {  // rows lane / 4 (d[4 j], d[4 j + 1]) and + 8 (d[4 j + 2], d[4 j + 3])
          acc_h[4 * j] = fmaf(part[4 * j], r0, acc_h[4 * j]);
          acc_h[4 * j + 1] = fmaf(part[4 * j + 1], r0, acc_h[4 * j + 1]);
          acc_h[4 * j + 2] = fmaf(part[4 * j + 2], r1, acc_h[4 * j + 2]);
          acc_h[4 * j + 3] = fmaf(part[4 * j + 3], r1, acc_h[4 * j + 3]);
        }
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) sw[h] = next_sw[h];
      s0 = next_s0;
      s1 = next_s1;
    }
    now = next;
    unsigned char* stage = smem + kE4m3Stages * S::kStageBytes + 128 + (4 * wg + warp) * 16 * kEpiloguePitch;
    write_rows<BN>(acc, stage, tile.first + 64 * wg + 16 * warp, tile.end, a.y, N, n0);
  }
#else
  __trap();  // launched on compute capability 9.0 only, where the sm_90a build is loaded
#endif
}

// A grouped product's persistent blocks: one a multiprocessor, or one a tile where there are fewer
// (at most x's rows / BM + E row tiles, by ceil(N / BN) column tiles).
dim3 persistent_grid(const at::Tensor& x, int64_t E, int64_t N, int BM, int BN) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
  const int64_t tiles = ((x.size(0) + BM - 1) / BM + E) * ((N + BN - 1) / BN);
  return dim3(unsigned(std::min<int64_t>(tiles, sms)));
}

// The e4m3 kernel's variants, as V4TRAIN_FP8_E4M3_VARIANTS names them (a comma list read at each
// call, so that one process can time each; unset or empty: both; none: neither, the kernels before
// them): `transpose_global`, the backward's weight transposed by transpose_fp8_kernel (kTurnBytes'
// groups of experts), then the forward's kernel, in place of the transposition in shared memory;
// `wide`, 128 x 256 tiles where the forward's kernel runs and the output is at least 256 wide. Both
// give the same bits as the kernels before them, faster (H100, GLM-5 proxy's MoE op: 15.5 -> 12.7 ms
// forward + backward; docs/benchmarks.md, twenty-second session). (A third, wide tiles in clusters of
// two sharing the weight's tile by TMA multicast, took 8.40 ms against 5.71: removed, 23rd session.)
enum E4m3Variant : unsigned { kTransposeGlobal = 1, kWide = 2 };  // (bit i: env_variants' name i)
unsigned e4m3_variants() {
  return env_variants("V4TRAIN_FP8_E4M3_VARIANTS", {"transpose_global", "wide"}, kTransposeGlobal | kWide);
}

// transpose_global's copy: experts in groups of at most a quarter of them and of kTurnBytes, each
// group turned into one buffer and multiplied before the next (in stream order: the buffer is free).
constexpr int64_t kTurnBytes = int64_t(256) << 20;

// x's rows quantised, then fp8_e4m3_kernel: y = x W_e^T, or x W_e where `transposed`.
void launch_e4m3(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offsets,
                 bool transposed, at::Tensor& out) {
  const int64_t E = weight.size(0), N = out.size(1), w_out = weight.size(1), w_in = weight.size(2);
  at::Tensor q, x_scale;
  quantize_rows(x, q, x_scale);
  const at::Tensor w = dense16(weight), s = scale.to(at::kFloat).contiguous(), off = offsets.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned variants = e4m3_variants();
  const CUtensorMap x_map = wgmma::tensor_map_swizzled(q.const_data_ptr(), q.size(0), q.size(1), q.size(1), kT, true);
  // Experts first.. first + n: their weight `we` [n, rows, cols] and scales `se` [n, rows / 128,
  // cols / 128], forward, or (`back`) backward with each tile transposed in the kernel.
  const auto multiply = [&](const at::Tensor& we, const float* se, int64_t first, int64_t n, bool back) {
    const int64_t rows = we.size(1), cols = we.size(2);
    const bool wide = !back && (variants & kWide) && N >= 2 * kT;
    const int bn = wide ? 2 * kT : kT;  // (the weight's box: the tile's columns)
    const CUtensorMap w_map = wgmma::tensor_map_swizzled(we.const_data_ptr(), n * rows, cols, cols, bn, true);
    const E4m3Args a{x_scale.const_data_ptr<float>(), se, off.const_data_ptr<int>(),
                     reinterpret_cast<__nv_bfloat16*>(out.mutable_data_ptr()), int(n), int(rows), int(cols),
                     int(q.size(0)), int(first)};
    const dim3 grid = persistent_grid(x, n, N, kT, bn);
    if (back) wgmma::launch(fp8_e4m3_kernel<true, kT>, grid, kThreads, E4m3<true>::kSmem, stream, x_map, w_map, a);
    else if (wide)
      wgmma::launch(fp8_e4m3_kernel<false, 2 * kT>, grid, kThreads, E4m3<false, 2 * kT>::kSmem, stream, x_map, w_map,
                    a);
    else wgmma::launch(fp8_e4m3_kernel<false, kT>, grid, kThreads, E4m3<false>::kSmem, stream, x_map, w_map, a);
  };
  if (!transposed || !(variants & kTransposeGlobal)) return multiply(w, s.const_data_ptr<float>(), 0, E, transposed);
  // The weight turned a group of experts at a time, then the forward's kernel on it.
  const int64_t per = w_out * w_in, group = std::max<int64_t>(1, std::min((E + 3) / 4, kTurnBytes / per));
  const at::Tensor st = s.transpose(1, 2).contiguous();  // [E, in / 128, out / 128]
  at::Tensor wt = at::empty({std::min(group, E), w_in, w_out}, w.options());
  for (int64_t first = 0; first < E; first += group) {
    const int64_t n = std::min(group, E - first);
    transpose_fp8_kernel<<<dim3(unsigned(w_in / kT), unsigned(w_out / kT), unsigned(n)), 128, 0, stream>>>(
        static_cast<const uint8_t*>(w.const_data_ptr()) + first * per, static_cast<uint8_t*>(wt.mutable_data_ptr()),
        int(w_out), int(w_in));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    multiply(wt, st.const_data_ptr<float>() + first * (per / (kT * kT)), first, n, false);
  }
}

// The tile: 256 x 128 (Tall) where the experts average 256 rows or more, else 128 x 256 (Wide), so
// that a tile's rows past its expert's end (multiplied, not stored) stay under half of it. On the
// H100 at 1,024 rows an expert (tools/benchmark.py's FP8 case of v4_glm5_moe) Tall's two forward
// launches took 4.61 ms against Wide's 5.15 and the dequantising path's 7.0 (fp8_grouped_kernel's
// forward, now `staged`; fp8_registers_kernel<false, 256>'s took 3.82 ms, its tile by Tall's); Wide at 128 rows an
// expert (GLM-5's 256 experts at 4,096 tokens on one GPU) is chosen by that count, not timed.
// V4TRAIN_FP8_GROUPED_TILE=128x256|256x128|off overrides it, read at each call so that one process
// can time each ("off" leaves the experts, and a dense backward asked on FP8 tensor cores, to the
// dequantising path; the products on FP8 tensor cores have one tile, 128 x 128).
enum class Choice { kWide, kTall, kOff };

// The kernel's variants, as V4TRAIN_FP8_GROUPED_VARIANTS names them (a comma list read at each call;
// unset or empty: none). Both ways run on fp8_registers_kernel (the weight turned from FP8 by the
// multiplying warps into wgmma's A registers, through ldmatrix .trans for the backward; x or dy by TMA
// as B; BT tokens a tile, the tile's rows: 256 for 256 x 128, 128 for 128 x 256): on the H100 the
// GLM-5 proxy's MoE op took 5.90 / 6.85 ms forward / backward against fp8_grouped_kernel's 6.73 / 7.48,
// the same bits (twenty-ninth session). `staged` names fp8_grouped_kernel both ways instead (the
// weight dequantised into shared memory), kept so that the CUDA test compares two independent kernels
// bit for bit.
enum GroupedVariant : unsigned { kStaged = 1 };  // (bit i: env_variants' name i)
unsigned grouped_variants() { return env_variants("V4TRAIN_FP8_GROUPED_VARIANTS", {"staged"}); }
Choice tile_choice(int64_t rows, int64_t experts) {
  const char* v = std::getenv("V4TRAIN_FP8_GROUPED_TILE");
  const std::string_view s = v == nullptr ? "" : v;
  TORCH_CHECK(s.empty() || s == "off" || s == "256x128" || s == "128x256", "V4TRAIN_FP8_GROUPED_TILE=", s,
              ": expected 128x256, 256x128 or off (unset: the kernel chooses)");
  if (s == "off") return Choice::kOff;
  if (!s.empty()) return s == "256x128" ? Choice::kTall : Choice::kWide;
  return rows >= 256 * experts ? Choice::kTall : Choice::kWide;
}

template <class S>
void launch(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offsets,
            bool transposed, at::Tensor& out) {
  // Pieces 4 h.. lie in scale block h of the tile's columns; warpgroups of 64-row products.
  static_assert(S::kPieces == 4 * S::kHalves && S::kSub * 128 == S::BM, "fp8_grouped: a tile the copies do not cut");
  const int64_t E = weight.size(0), rows = x.size(0), N = out.size(1);
  const at::Tensor w = dense16(weight), s = scale.to(at::kFloat).contiguous(), off = offsets.contiguous();
  const at::Tensor xs = dense16(x);
  const CUtensorMap x_map = wgmma::tensor_map_swizzled(xs.const_data_ptr(), rows, xs.size(1), xs.size(1), S::BM);
  const Args a{static_cast<const uint8_t*>(w.const_data_ptr()), s.const_data_ptr<float>(), off.const_data_ptr<int>(),
               reinterpret_cast<__nv_bfloat16*>(out.mutable_data_ptr()), int(E), int(weight.size(1)),
               int(weight.size(2))};
  const dim3 grid = persistent_grid(x, E, N, S::BM, S::BN);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  using R = Rs<S::BM>;
  if (!(grouped_variants() & kStaged) && wgmma::capable(x.get_device(), R::kSmem)) {
    // The weight [E out, in] as bytes: forward in boxes of 128 rows x 64 (the 64-byte swizzle), transposed
    // of 64 rows (out, the sum) x 128 (in, the features; the 128-byte swizzle, whose box row is 128 bytes).
    // Either box is the stage's kWTile bytes, which its barrier expects (another size hangs the kernel).
    static_assert(kRsRows * kBK == R::kWTile && kBK * 128 == R::kWTile, "fp8_registers: a weight box of kWTile bytes");
    const int64_t w_rows = E * weight.size(1), in = weight.size(2);
    const void* w0 = w.const_data_ptr();
    const CUtensorMap w_map = transposed ? wgmma::tensor_map_swizzled(w0, w_rows, in, in, kBK, true)
                                         : wgmma::tensor_map_swizzled(w0, w_rows, in, in, kRsRows, true, kBK);
    const dim3 rs_grid = persistent_grid(x, E, N, S::BM, kRsRows);
    if (transposed)
      wgmma::launch(fp8_registers_kernel<true, S::BM>, rs_grid, kThreads, R::kSmem, stream, x_map, w_map, a);
    else wgmma::launch(fp8_registers_kernel<false, S::BM>, rs_grid, kThreads, R::kSmem, stream, x_map, w_map, a);
    return;
  }
  if (transposed) wgmma::launch(fp8_grouped_kernel<true, S>, grid, kThreads, S::kSmem, stream, x_map, a);
  else wgmma::launch(fp8_grouped_kernel<false, S>, grid, kThreads, S::kSmem, stream, x_map, a);
}

bool fp8_grouped_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                         const at::Tensor& offsets, bool transposed, bool e4m3, at::Tensor& out) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || x.dim() != 2 || weight.dim() != 3) return false;
  if (weight.scalar_type() != at::kFloat8_e4m3fn || weight.device() != x.device()) return false;
  const int64_t E = weight.size(0), w_out = weight.size(1), w_in = weight.size(2), rows = x.size(0);
  const int64_t K = transposed ? w_out : w_in, N = transposed ? w_in : w_out;
  // Whole scale blocks: the sum's steps never straddle a partial one.
  if (rows == 0 || E == 0 || w_out == 0 || w_in == 0 || w_out % kScaleBlock != 0 || w_in % kScaleBlock != 0 ||
      x.size(1) != K)
    return false;
  // int indices: rows, widths, and the (row tile, column tile) pairs, at most rows / 128 + E row tiles.
  // (TMA's coordinates: the weight's rows E out, or turned E in, as one int.)
  if (rows + 256 > INT_MAX || E * w_out > INT_MAX || E * w_in > INT_MAX ||
      ((rows + 127) / 128 + E) * (N / 128) > INT_MAX)
    return false;
  if (offsets.scalar_type() != at::kInt || offsets.numel() != E || offsets.device() != x.device()) return false;
  if (scale.device() != x.device() || scale.dim() != 3 || scale.size(0) != E || scale.size(1) != w_out / kScaleBlock ||
      scale.size(2) != w_in / kScaleBlock)
    return false;
  const Choice choice = tile_choice(rows, E);
  if (choice == Choice::kOff) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  if (e4m3 && wgmma::capable(x.get_device(), E4m3<false, 2 * kT>::kSmem)) {  // (the largest)
    out = at::empty({rows, N}, x.options());
    launch_e4m3(x, weight, scale, offsets, transposed, out);
    return true;
  }
  const bool use_tall = choice == Choice::kTall;
  if (!wgmma::capable(x.get_device(), use_tall ? Tall::kSmem : Wide::kSmem)) return false;
  out = at::empty({rows, N}, x.options());
  if (use_tall) launch<Tall>(x, weight, scale, offsets, transposed, out);
  else launch<Wide>(x, weight, scale, offsets, transposed, out);
  return true;
}

const Backend<Fp8GroupedProduct>::Register registered(c10::DeviceType::CUDA, &fp8_grouped_product);

}  // namespace
}  // namespace v4::cuda
