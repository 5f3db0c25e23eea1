// Hopper's warpgroup tensor-core products (wgmma, PTX ISA 9.7.15) on shared-memory tiles, in the
// canonical layout without swizzle (a tile cut into "core matrices" of 8 rows x 16 bytes, each 128
// contiguous bytes; the descriptor names the byte distance between core matrices along K, the
// leading offset, and along M or N, the stride offset) or with 128-byte swizzle (desc128,
// sw128_offset); and the warp-specialisation primitives (mbarriers, named barriers, setmaxnreg).
// Compiled for sm_90a only (the `wgmma.*` instructions exist nowhere else): callers guard their
// kernels' bodies with V4_HAS_WGMMA and launch them on compute capability 9.0 alone.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define V4_HAS_WGMMA 1
#endif

namespace v4::wgmma {

// The largest dynamic shared memory a block may ask for on `device`.
inline int max_smem(int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return value;
}

// Compute capability 9.0, where the wgmma kernels' sm_90a build runs, with `smem` bytes for a block.
inline bool capable(int device, size_t smem) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0 && smem <= size_t(max_smem(device));
}

// The tensor-memory-accelerator map (TMA, PTX ISA 9.7.9.25) of a row-major bf16 matrix [rows, cols]
// (row stride ld elements, 16-byte aligned) whose loads (tma_load_2d) copy boxes of box_rows rows x 64
// columns, 128 bytes a row, into sw128_offset's layout; rows past the end land as zeros. With
// `bytes`, a matrix of 1-byte elements (FP8) in boxes of box_rows x 128. With box_bytes 64, boxes of
// 64-byte rows (32 bf16 or 64 bytes) under the 64-byte swizzle: row r at 64 r, its 16-byte chunk c at
// chunk c ^ (r / 2) % 4 (address bits 4-5 ^= bits 7-8; the tile on 512 bytes). The driver's encoder
// is found through the runtime, so nothing links libcuda.
// (`box_bytes`: a box row's bytes, 128 or 64, and the swizzle's width with it.)
inline CUtensorMap tensor_map_swizzled(const void* base, int64_t rows, int64_t cols, int64_t ld, int box_rows,
                                    bool bytes = false, int box_bytes = 128) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(fn != nullptr && found == cudaDriverEntryPointSuccess, "the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  // The driver's encoder needs a context current on this thread, which autograd's backward thread
  // may not have yet (the first product there failed with 201, invalid context): since CUDA 12
  // cudaSetDevice makes the device's primary context current.
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaSetDevice(device));
  TORCH_CHECK(box_bytes == 128 || box_bytes == 64, "tensor_map_swizzled: boxes of 128- or 64-byte rows");
  CUtensorMap map;
  const int size = bytes ? 1 : 2;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)}, strides[1] = {cuuint64_t(ld) * size};
  const cuuint32_t box[2] = {cuuint32_t(box_bytes / size), cuuint32_t(box_rows)}, unit[2] = {1, 1};
  const CUresult r = encode(&map, bytes ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                            const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", int(r), ") on a [", rows, ", ", cols, "] ",
              bytes ? "1-byte" : "bf16", " matrix of row stride ", ld, " in boxes of ", box_rows, " x ",
              box_bytes / size);
  return map;
}

// kernel<<<grid, threads, smem, stream>>>(args...), its dynamic shared memory allowed up to smem.
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, int threads, size_t smem, cudaStream_t stream, A&&... args) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, threads, smem, stream>>>(std::forward<A>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The descriptor of a tile at shared address `addr`, no swizzle.
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t k_stride_bytes, uint32_t mn_stride_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(k_stride_bytes >> 4) << 16 | uint64_t(mn_stride_bytes >> 4) << 32;
}

// The same with 128-byte swizzle: the tile is cut into blocks of 64 columns (Rows rows of 128
// bytes each), and within a row the 16-byte chunks are permuted by the row's place in its group of 8
// (chunk ^ row % 8), so that 8 threads copying a row's 128 contiguous bytes, or a product reading 8
// rows' same chunk, touch every bank once. The tile must start on 1,024 bytes. The descriptor's
// two distances (CUTLASS's canonical layouts): K-major operands, `lead_bytes` unused (the two
// 8-column halves of a 16-column step lie side by side) and `stride_bytes` the 8-row groups' (1,024),
// a step of 16 columns 32 bytes on within a block; MN-major operands, `lead_bytes` the blocks'
// distance along MN (Rows * 128) and `stride_bytes` the 8-row groups' along K (1,024). The swizzle
// is a function of the address bits (chunk bits 4-6 ^= row bits 7-9), so an operand may also start
// 32 or 64 bytes into its rows (a K step; the sparse backward's 32-column MN-major halves, checked
// by its dq and dkv parity), as long as its rows start on 1,024 (bits 7-9 zero: base offset 0).
__device__ __forceinline__ uint64_t desc128(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return desc(addr, lead_bytes, stride_bytes) | uint64_t(1) << 62;
}
// Descriptor d moved `bytes` on (a multiple of 16). The start address is its low 14 bits, in 16-byte
// units, and shared memory (under 256 KB) never carries out of them, so one 32-bit add stands for
// desc's masks and shifts: in the e4m3 kernel those were a third of a multiplying warp's
// instructions a step (ncu, 2026-12-06), a chain of five uniform operations before each product.
__device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}
template <int Rows>
__device__ __forceinline__ int sw128_offset(int row, int col) {
  return (col / 64) * (Rows * 128) + row * 128 + (((col % 64) / 8) ^ (row % 8)) * 16 + (col % 8) * 2;
}
// The byte offset of a K-major operand's 16-column step kk: 32 bytes on within a 64-column block.
template <int Rows>
__device__ __forceinline__ int sw128_k_step(int kk) {
  return kk / 4 * (Rows * 128) + kk % 4 * 32;
}
__device__ __forceinline__ uint32_t saddr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared without passing through registers (cp.async), or 16 zero bytes where
// !valid; in flight until a wait (or an mbarrier's bar_arrive_copies) says they landed.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// The first byte of dynamic shared memory `p` on which swizzled tiles may start (kernels ask for
// 1,024 bytes more than they carve).
__device__ __forceinline__ unsigned char* sw128_aligned(unsigned char* p) { return p + (1024 - saddr(p) % 1024) % 1024; }

// Byte offset of (row, col) of 16-bit elements in a tile of Rows rows of core matrices: row groups
// 128 bytes apart, column groups of 8 Rows * 16 bytes apart. Its descriptor strides: Rows * 16
// along the columns, 128 along the rows, whichever of them is K.
template <int Rows>
__device__ __forceinline__ int tile_offset(int row, int col) {
  return ((col / 8) * (Rows / 8) + row / 8) * 128 + (row % 8) * 16 + (col % 8) * 2;
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Writes to shared memory by threads (st.shared, cp.async) made visible to the tensor core's reads.
__device__ __forceinline__ void fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The accumulator operands of a product N columns wide: its N / 2 registers, named %0.. in the
// instruction text and bound to d[0..] (each list extends the one before).
#define V4_WGMMA_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define V4_WGMMA_OUT16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define V4_WGMMA_REGS32 V4_WGMMA_REGS16 ", " "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define V4_WGMMA_OUT32 \
  V4_WGMMA_OUT16, \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define V4_WGMMA_REGS64 \
  V4_WGMMA_REGS32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define V4_WGMMA_OUT64 \
  V4_WGMMA_OUT32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define V4_WGMMA_REGS128 \
  V4_WGMMA_REGS64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define V4_WGMMA_OUT128 \
  V4_WGMMA_OUT64, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d [64 x N] += a [64 x 16] . b [16 x N], both from shared memory; TransA / TransB 0 for a
// K-major operand, 1 for an MN-major one (a read transposed). d is the warpgroup's accumulator
// fragment: thread (warp w, lane l) holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1) as
// d[4j..4j+3].
#define V4_WGMMA_M64N32(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {" V4_WGMMA_REGS16 \
               "}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
               : V4_WGMMA_OUT16 \
               : "l"(a), "l"(b), "n"(1), "n"(TransA), "n"(TransB))

#define V4_WGMMA_M64N64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" V4_WGMMA_REGS32 \
               "}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
               : V4_WGMMA_OUT32 \
               : "l"(a), "l"(b), "n"(1), "n"(TransA), "n"(TransB))

#define V4_WGMMA_M64N256(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" V4_WGMMA_REGS128 \
               "}, %128, %129, p, 1, 1, %131, %132;\n}\n" \
               : V4_WGMMA_OUT128 \
               : "l"(a), "l"(b), "n"(1), "n"(TransA), "n"(TransB))

#define V4_WGMMA_M64N128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" V4_WGMMA_REGS64 \
               "}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
               : V4_WGMMA_OUT64 \
               : "l"(a), "l"(b), "n"(1), "n"(TransA), "n"(TransB))

template <typename T, int N, int TransA = 0, int TransB = 0>
__device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t a, uint64_t b) {
  static_assert(N == 32 || N == 64 || N == 128 || N == 256, "v4::wgmma::mma: N of 32, 64, 128 or 256");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if constexpr (N == 32) V4_WGMMA_M64N32("bf16");
    else if constexpr (N == 64) V4_WGMMA_M64N64("bf16");
    else if constexpr (N == 128) V4_WGMMA_M64N128("bf16");
    else V4_WGMMA_M64N256("bf16");
  } else {
    if constexpr (N == 32) V4_WGMMA_M64N32("f16");
    else if constexpr (N == 64) V4_WGMMA_M64N64("f16");
    else if constexpr (N == 128) V4_WGMMA_M64N128("f16");
    else V4_WGMMA_M64N256("f16");
  }
}

#undef V4_WGMMA_M64N32
#undef V4_WGMMA_M64N64
#undef V4_WGMMA_M64N128
#undef V4_WGMMA_M64N256

// d [64 x 128] (+)= a [64 x 32] . b [32 x 128] in float8_e4m3fn, both K-major in shared memory (8-bit
// operands have no transposed form), fp32 accumulators laid out as mma's; `accumulate` false
// overwrites d (the first product of a sum). A K step of 32 is 32 bytes: sw128_k_step's offsets of a
// 16-bit operand's 16 columns.
__device__ __forceinline__ void mma_e4m3(float (&d)[64], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" V4_WGMMA_REGS64 "}, %64, %65, p, 1, 1;\n}\n"
               : V4_WGMMA_OUT64
               : "l"(a), "l"(b), "r"(int(accumulate)));
}

// d [64 x N] += a [64 x 16] . b [16 x N] (N 256 or 128) with a from registers (bf16 or f16 pairs): thread
// (warp w, lane l) holds a's rows 16w + l/4 (+8), columns 2(l%4) (+1) (+8) as a[0] (row, col),
// a[1] (row + 8, col), a[2] (row, col + 8), a[3] (row + 8, col + 8). That is an accumulator
// fragment's columns 16k.. packed in pairs, so a product's scores feed the next product as they lie.
// b from shared memory, MN-major (TransB 1) or K-major (0).
#define V4_WGMMA_M64N256_RS(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" V4_WGMMA_REGS128 \
               "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n" \
               : V4_WGMMA_OUT128 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1), "n"(TransB))

#define V4_WGMMA_M64N128_RS(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" V4_WGMMA_REGS64 \
               "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
               : V4_WGMMA_OUT64 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1), "n"(TransB))

// N: 256 or 128 (d of N / 2).
template <typename T, int TransB = 1, int N = 256>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t* a, uint64_t b) {
  static_assert(N == 128 || N == 256, "v4::wgmma::mma_rs: N of 128 or 256");
  if constexpr (N == 128) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) V4_WGMMA_M64N128_RS("bf16");
    else V4_WGMMA_M64N128_RS("f16");
  } else {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) V4_WGMMA_M64N256_RS("bf16");
    else V4_WGMMA_M64N256_RS("f16");
  }
}
#undef V4_WGMMA_M64N256_RS
#undef V4_WGMMA_M64N128_RS
#undef V4_WGMMA_REGS16
#undef V4_WGMMA_REGS32
#undef V4_WGMMA_REGS64
#undef V4_WGMMA_REGS128
#undef V4_WGMMA_OUT16
#undef V4_WGMMA_OUT32
#undef V4_WGMMA_OUT64
#undef V4_WGMMA_OUT128

// Registers an in-flight product writes, pinned: the compiler may neither read nor move them
// across this point (after a wait, before the values are used).
template <int N>
__device__ __forceinline__ void fence_operand(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// ---- Warp specialisation: shared-memory barriers (mbarrier) that count arrivals, cp.async's
// arrival once a thread's copies land, named barriers between warpgroups, and the register
// budget moved from a warpgroup that only copies to those that compute.
__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(saddr(bar)), "r"(count));
}
// Makes the barriers' initialisation visible before any thread uses them (then __syncthreads).
__device__ __forceinline__ void bar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(saddr(bar)) : "memory");
}
// The barrier counts one arrival when all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void bar_arrive_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(saddr(bar)) : "memory");
}
// One arrival that also tells the barrier to wait for `bytes` more bytes of asynchronous copies (TMA).
__device__ __forceinline__ void bar_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(saddr(bar)), "r"(bytes) : "memory");
}
// The box of `map` at (col, row) copied to shared `dst` (1,024-byte aligned for the swizzle); its
// bytes counted off `bar` as they land.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int col, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          saddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(saddr(bar))
      : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed (the phases alternate 0, 1, 0..;
// a fresh barrier counts the phase before its first, of parity 1, as complete).
__device__ __forceinline__ void bar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(saddr(bar)),
      "r"(parity)
      : "memory");
}
// Named barrier `id` (1..15) of `threads` threads: sync waits for all of them, arrive only counts.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int Regs>
__device__ __forceinline__ void regs_grow() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs)); }
template <int Regs>
__device__ __forceinline__ void regs_shrink() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs)); }

}  // namespace v4::wgmma
