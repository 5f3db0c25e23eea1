// Checks cc/common/wgmma.cuh's layouts on the GPU (not built by Bazel or build_ext):
//   nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -I. tools/wgmma_probe.cu -o /tmp/probe && /tmp/probe
// S = Q K^T (m64n32, both K-major), O = P V (m64n256, V MN-major) and D = P^T Q[:, :64] (m64n64,
// both MN-major: the sparse backward's dkv) on the kernels' core-matrix tiles, small integers (exact).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
#include "cc/common/wgmma.cuh"
using T = __nv_bfloat16;
__device__ uint32_t saddr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__global__ void probe(const T* q, const T* k, const T* p, float* s_out, float* o_out, float* d_out) {
#if defined(V4_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char sm[];
  unsigned char *sQ = sm, *sK = sm + 73728, *sP = sm + 2 * 73728;
  for (int i = threadIdx.x; i < 64 * 576; i += 256) {
    const int r = i / 576, c = i % 576;
    *reinterpret_cast<T*>(sQ + v4::wgmma::tile_offset<64>(r, c)) = q[i];
    *reinterpret_cast<T*>(sK + v4::wgmma::tile_offset<64>(r, c)) = k[i];
  }
  for (int i = threadIdx.x; i < 64 * 64; i += 256) *reinterpret_cast<T*>(sP + v4::wgmma::tile_offset<64>(i / 64, i % 64)) = p[i];
  v4::wgmma::fence_shared();
  __syncthreads();
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float s[16] = {};
  v4::wgmma::fence();
  for (int kk = 0; kk < 36; ++kk)
    v4::wgmma::mma<T, 32>(s, v4::wgmma::desc(saddr(sQ) + kk * 2048, 1024, 128),
                         v4::wgmma::desc(saddr(sK) + wg * 512 + kk * 2048, 1024, 128));
  v4::wgmma::commit();
  v4::wgmma::wait<0>();
  float acc[128] = {};
  v4::wgmma::fence();
  for (int kk = 0; kk < 4; ++kk)
    v4::wgmma::mma<T, 256, 0, 1>(acc, v4::wgmma::desc(saddr(sP) + kk * 2048, 1024, 128),
                                  v4::wgmma::desc(saddr(sK) + wg * 32 * 1024 + kk * 256, 128, 1024));
  v4::wgmma::commit();
  v4::wgmma::wait<0>();
  float dk[16] = {};  // warpgroup w: D's columns 32w.. (m64n32 of the 64: both operands MN-major)
  v4::wgmma::fence();
  for (int kk = 0; kk < 4; ++kk)
    v4::wgmma::mma<T, 32, 1, 1>(dk, v4::wgmma::desc(saddr(sP) + kk * 256, 128, 1024),
                                v4::wgmma::desc(saddr(sQ) + wg * 4 * 1024 + kk * 256, 128, 1024));
  v4::wgmma::commit();
  v4::wgmma::wait<0>();
  const int r = 16 * warp + lane / 4, c = 2 * (lane % 4);
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 4; ++e) d_out[(r + 8 * (e / 2)) * 64 + wg * 32 + 8 * j + c + e % 2] = dk[4 * j + e];
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 4; ++e) s_out[(r + 8 * (e / 2)) * 64 + wg * 32 + 8 * j + c + e % 2] = s[4 * j + e];
  for (int j = 0; j < 32; ++j)
    for (int e = 0; e < 4; ++e) o_out[(r + 8 * (e / 2)) * 512 + wg * 256 + 8 * j + c + e % 2] = acc[4 * j + e];
#endif
}
int main() {
  std::vector<T> q(64 * 576), k(64 * 576), p(64 * 64);
  std::vector<float> qf(q.size()), kf(k.size()), pf(p.size());
  srand(1);
  for (size_t i = 0; i < q.size(); ++i) { qf[i] = rand() % 5 - 2; kf[i] = rand() % 5 - 2; q[i] = qf[i]; k[i] = kf[i]; }
  for (size_t i = 0; i < p.size(); ++i) { pf[i] = rand() % 5 - 2; p[i] = pf[i]; }
  T *dq, *dk, *dp; float *ds, *dout, *dd;
  cudaMalloc(&dq, q.size() * 2); cudaMalloc(&dk, k.size() * 2); cudaMalloc(&dp, p.size() * 2);
  cudaMalloc(&ds, 64 * 64 * 4); cudaMalloc(&dout, 64 * 512 * 4); cudaMalloc(&dd, 64 * 64 * 4);
  cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice);
  const int smem = 2 * 73728 + 8192;
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  probe<<<1, 256, smem>>>(dq, dk, dp, ds, dout, dd);
  cudaError_t e = cudaDeviceSynchronize();
  printf("launch: %s\n", cudaGetErrorString(e));
  std::vector<float> s(64 * 64), o(64 * 512), d(64 * 64);
  cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
  int bad_s = 0, bad_o = 0;
  for (int r = 0; r < 64; ++r)
    for (int j = 0; j < 64; ++j) {
      float ref = 0; for (int c = 0; c < 576; ++c) ref += qf[r * 576 + c] * kf[j * 576 + c];
      if (ref != s[r * 64 + j] && bad_s++ < 4) printf("S[%d,%d] %g want %g\n", r, j, s[r * 64 + j], ref);
    }
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 512; ++c) {
      float ref = 0; for (int j = 0; j < 64; ++j) ref += pf[r * 64 + j] * kf[j * 576 + c];
      if (ref != o[r * 512 + c] && bad_o++ < 4) printf("O[%d,%d] %g want %g\n", r, c, o[r * 512 + c], ref);
    }
  int bad_d = 0;
  for (int key = 0; key < 64; ++key)
    for (int c = 0; c < 64; ++c) {
      float ref = 0; for (int h = 0; h < 64; ++h) ref += pf[h * 64 + key] * qf[h * 576 + c];
      if (ref != d[key * 64 + c] && bad_d++ < 4) printf("D[%d,%d] %g want %g\n", key, c, d[key * 64 + c], ref);
    }
  printf("wgmma probe: S wrong %d of 4096, O wrong %d of 32768, D wrong %d of 4096\n", bad_s, bad_o, bad_d);
  return bad_s || bad_o || bad_d;
}
