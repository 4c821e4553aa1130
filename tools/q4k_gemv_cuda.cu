// A hand-written CUDA Q4_K GEMV: the first attempt at the CUDA path (fifth session). Run it on a GPU
// with `python tools/probe_q4k_cuda.py` (nvcc builds it there; the driver API launches it). On the
// H200 it matched the naive GEMV and was slower than the Triton kernel (29.78 us at 14336 x 4096;
// docs/h200_2026-11-30_s5/gemv_experiments/cuda_first_attempt.txt): every CTA rebuilds x in shared
// memory and each warp then streams about one row with nothing in flight behind it. The next
// version wants many rows per warp, the next row's loads issued before this row's arithmetic, and
// x prepared once.
//
// Q4_K GEMV, batch 1, bf16 x and y, fp32 arithmetic. Each warp streams whole rows: lane (b, h) holds
// block b of the 16 in flight and chunks 2h, 2h+1 of it. x lives in shared memory as fp32, padded per
// block so the lanes of a warp do not share banks, with per-sub-block sums beside it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define PAD 260  // floats per block of x in shared memory (256 + 4: a 4-bank shift per block)

__device__ __forceinline__ float code_f(uint32_t v, int at) {  // 1 + q/16 for the code at bit `at`
  uint32_t m = at <= 19 ? (v << (19 - at)) : (v >> (at - 19));
  return __uint_as_float((m & 0x00780000u) | 0x3F800000u);
}

__device__ __forceinline__ float byte_f(uint32_t w, uint32_t sel) {  // byte of w as float
  return __uint_as_float(__byte_perm(w, 0x4B000000u, sel)) - 8388608.0f;
}

extern "C" __global__ void __launch_bounds__(256) q4k_gemv_b1(
    const uint4* __restrict__ W, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
    int n_rows, int n_blocks) {
  extern __shared__ float smem[];
  float* xs = smem;                       // n_blocks * PAD
  float* xsum = smem + n_blocks * PAD;    // n_blocks * 8
  const int K = n_blocks * 256;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    xs[(i >> 8) * PAD + (i & 255)] = __bfloat162float(x[i]);
  }
  __syncthreads();
  for (int s = threadIdx.x; s < n_blocks * 8; s += blockDim.x) {
    const float* p = xs + (s >> 3) * PAD + (s & 7) * 32;
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) t += p[i];
    xsum[s] = t;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, h = lane & 1, bl = lane >> 1;
  const int warps = gridDim.x * (blockDim.x >> 5);
  const int wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int row_u4 = n_blocks * 9;  // 144 B = 9 uint4 per block
  for (int row = wid; row < n_rows; row += warps) {
    const uint4* wr = W + (size_t)row * row_u4;
    float acc = 0.f;
    for (int b0 = 0; b0 < n_blocks; b0 += 16) {
      const int b = b0 + bl;
      if (b < n_blocks) {
        const uint4* blk = wr + b * 9;
        const uint4 hd = blk[0];
        // chunks 2h and 2h+1: 64 bytes = uint4 pieces 1 + 4h .. 4 + 4h
        uint4 q[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = blk[1 + 4 * h + i];
        const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&hd.x));
        const uint32_t s1 = hd.y, s2 = hd.z, s3 = hd.w;
        const uint32_t sc_lo = s1 & 0x3F3F3F3Fu, m_lo = s2 & 0x3F3F3F3Fu;
        const uint32_t sc_hi = (s3 & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
        const uint32_t m_hi = ((s3 >> 4) & 0x0F0F0F0Fu) | ((s2 >> 2) & 0x30303030u);
        const float* xb = xs + b * PAD;
        const float* sb = xsum + b * 8;
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int c = 2 * h + cc;  // chunk: sub-blocks 2c (low nibbles) and 2c+1 (high)
          const int j0 = 2 * c, j1 = 2 * c + 1;
          // sub-blocks j0, j1: bytes j of sc_lo (j < 4) or byte j-4 of sc_hi
          const uint32_t scw = c < 2 ? sc_lo : sc_hi, mw = c < 2 ? m_lo : m_hi;
          const uint32_t sel0 = 0x7440u | (j0 & 3), sel1 = 0x7440u | (j1 & 3);
          const float slope0 = 16.f * dm.x * byte_f(scw, sel0), slope1 = 16.f * dm.x * byte_f(scw, sel1);
          const float min0 = dm.y * byte_f(mw, sel0), min1 = dm.y * byte_f(mw, sel1);
          float a0 = 0.f, a1 = 0.f;
          const uint32_t* wv = reinterpret_cast<const uint32_t*>(&q[2 * cc]);
#pragma unroll
          for (int w = 0; w < 8; ++w) {
            const uint32_t v = wv[w];
            const float4 xl = *reinterpret_cast<const float4*>(xb + 64 * c + 4 * w);
            const float4 xh = *reinterpret_cast<const float4*>(xb + 64 * c + 32 + 4 * w);
            a0 = fmaf(code_f(v, 0), xl.x, a0);
            a0 = fmaf(code_f(v, 8), xl.y, a0);
            a0 = fmaf(code_f(v, 16), xl.z, a0);
            a0 = fmaf(code_f(v, 24), xl.w, a0);
            a1 = fmaf(code_f(v, 4), xh.x, a1);
            a1 = fmaf(code_f(v, 12), xh.y, a1);
            a1 = fmaf(code_f(v, 20), xh.z, a1);
            a1 = fmaf(code_f(v, 28), xh.w, a1);
          }
          const float x0 = sb[j0], x1 = sb[j1];
          acc += slope0 * (a0 - x0) - min0 * x0 + slope1 * (a1 - x1) - min1 * x1;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[row] = __float2bfloat16_rn(acc);
  }
}
