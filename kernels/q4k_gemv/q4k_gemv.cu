
// Q4_K GEMV, batch 1, on the tensor cores.
#include <cuda_runtime.h>
typedef unsigned int u32;
typedef unsigned short u16;

#define WARPS 8
#define ROWS 16
#define BLOCK_BYTES 144
#define CHUNK_BLOCKS 8                           // Q4_K blocks per row in one chunk (one per warp)
#define SEGMENT_BYTES (CHUNK_BLOCKS * BLOCK_BYTES)  // 1152 B of a row: nine whole 128-B lines
#define ROW_STRIDE (SEGMENT_BYTES + 16)              // in shared memory: 4 banks apart per row
#define SLOT_BYTES (ROWS * ROW_STRIDE)
#ifndef MIN_CTAS
#define MIN_CTAS 2
#endif

struct alignas(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 shared_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {  // arrive, and expect bytes
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {  // until that phase completes
  asm volatile(
      "{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; "
      "@!done bra WAIT_%=; }" ::"r"(bar), "r"(parity) : "memory");
}
// The bulk-copy engine moves `bytes` from global to shared memory and counts them on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ U4 lds128(u32 addr) {
  U4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// d times byte `selector & 3` of `word` (a 6-bit scale or min), in two full-rate instructions
// where a shift, a mask, an I2F and an FMUL were: PRMT builds the float 0x4B0000bb = 2^23 + bb
// (`selector` is 0x7540 | byte: the other result bytes are 0x00, 0x00, 0x4B), and one FMA takes
// d * 2^23 (`minus_d_2_23`, exact, once per row) off d * (2^23 + bb), rounding once: exactly
// the product d * bb. (Only a d of -0 or inf would differ: +0 for -0 * bb, NaN for inf * bb.)
__device__ __forceinline__ float times_byte(float d, float minus_d_2_23, u32 word, u32 selector) {
  return fmaf(d, __uint_as_float(__byte_perm(word, 0x4B000000u, selector)), minus_d_2_23);
}

__device__ __forceinline__ u32 opaque(u32 v) {  // a value the compiler must keep, not rebuild
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
// D = A (16x32, u8 codes) * B (32x8, bytes of x) + C, int32 accumulate: exact. One wrapper
// per type of x's bytes: s8 (the batch-1 kernel's, and the batched kernel's high bytes) and u8
// (the batched kernel's low bytes).
#define MMA_BYTES(name, x_type)                                                                    \
  __device__ __forceinline__ void name(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) { \
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8." x_type ".s32 {%0,%1,%2,%3}, "       \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                          \
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])                                 \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                         \
  }
MMA_BYTES(mma_signed, "s8")
MMA_BYTES(mma_unsigned, "u8")

__device__ __forceinline__ float to_float(u32 word, int high, int x_is_bf16) {
  if (x_is_bf16) return __uint_as_float(high ? (word & 0xFFFF0000u) : (word << 16));
  return half_to_float((u16)(high ? (word >> 16) : (word & 0xFFFFu)));
}
__device__ __forceinline__ u16 from_float(float v, int x_is_bf16) {
  if (x_is_bf16) {
    u32 bits = __float_as_uint(v);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((bits >> 16) | 0x40u);  // NaN stays NaN
    return (u16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// Eight values of x (raw: 16 bytes, bf16 or fp16), one lane's quarter of a 32-value sub-block
// whose other quarters are in the lanes l ^ 1, l ^ 2, l ^ 3, as int16 split into a signed high
// byte and a low byte: per sub-block a power-of-two scale puts max |x| in [2^13, 2^14), and
// x = unscale * (256 hi + lo), lo signed (SignedLow, in [-128, 128), hi then in [-64, 64]) or
// unsigned. Also the sub-block's float sum of x (for the min term).
struct XBytes {
  u32 hi[2], lo[2];
  float unscale, sum;
};
template <bool SignedLow>
__device__ __forceinline__ XBytes x_as_bytes(U4 raw, int x_is_bf16) {
  const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
  float v[8], biggest = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = to_float(words[i >> 1], i & 1, x_is_bf16);
    biggest = fmaxf(biggest, fabsf(v[i]));
  }
  biggest = fmaxf(biggest, __shfl_xor_sync(0xFFFFFFFFu, biggest, 1));
  biggest = fmaxf(biggest, __shfl_xor_sync(0xFFFFFFFFu, biggest, 2));
  const int e = (__float_as_uint(biggest) >> 23) & 0xFF;
  // 2^(140 - e) as an exponent field, kept normal both ways; a sub-block below 2^-99 rounds
  // coarser, and inf or NaN zeroes the bytes (its sum, below, carries it)
  const int field = min(max(267 - e, 14), 240);
  const float scale = e == 255 ? 0.f : __uint_as_float((u32)field << 23);
  XBytes out;
  out.unscale = __uint_as_float((u32)(254 - field) << 23);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int q[4];
    // round to nearest int: 1.5 * 2^23 puts it in the low bits; signed, 128 more, so that
    // q + 128 = 256 hi + r with r in [0, 256), and lo = r - 128 is r with its top bit flipped.
    // The float's bits are 0x4B400000 + q (+ 128): their low 16 bits, all the permutes below
    // take, are q's own, so the offset is never subtracted (one instruction per value).
    const float magic = SignedLow ? 12583040.f : 12582912.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __float_as_int(fmaf(v[4 * half + i], scale, magic));
    const u32 p01 = __byte_perm(q[0], q[1], 0x5140), p23 = __byte_perm(q[2], q[3], 0x5140);
    out.lo[half] = __byte_perm(p01, p23, 0x5410) ^ (SignedLow ? 0x80808080u : 0u);
    out.hi[half] = __byte_perm(p01, p23, 0x7632);
  }
  float sum = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
  out.sum = sum;
  return out;
}

// A line of zeros (what non-feeding lanes give the MMA as x) and the ring's barriers: `full`
// completes when a slot's bytes have landed, `empty` when every consumer warp has released it.
__device__ __forceinline__ void ring_init(unsigned char* zero_line, u32 full, u32 empty, int stages, int tid) {
  if (tid < 16) reinterpret_cast<u32*>(zero_line)[tid] = 0u;
  if (tid < stages) {
    bar_init(full + 8 * tid, 1);
    bar_init(empty + 8 * tid, WARPS);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
}

// A consumer warp is done reading a slot: once all its lanes have, one arrival for the warp.
__device__ __forceinline__ void release_slot(u32 empty, int slot, int lane) {
  __syncwarp();
  if (lane == 0) bar_arrive(empty + 8 * slot);
}
// The next ring slot, and the round (barrier phase) it is in.
__device__ __forceinline__ void next_slot(int& slot, int& round, int stages) {
  if (++slot == stages) slot = 0, ++round;
}

// The producer warp: streams the CTA's (tile, chunk) items through the ring of `stages` slots,
// one bulk copy per row (lanes 0-15), each slot refilled once its consumers have released it.
// Launched as a programmatic dependent, it streams the first `before_wait` items while the
// kernel ahead still runs and the rest once that kernel has ended (see items_before_wait).
// The CTA's tiles are first_tile, first_tile + tile_step, ...; `W` points at the first of the
// `n_blocks` blocks of each row it reads, rows `row_bytes` apart.
__device__ __forceinline__ void produce(const unsigned char* __restrict__ W, long long row_bytes, int n_rows,
                                        int n_blocks, int items, int n_chunks, int stages, int before_wait,
                                        u32 ring, u32 full, u32 empty, int lane, int first_tile, int tile_step) {
  for (int i = 0, slot = 0, round = 0; i < items; ++i) {
    if (i == before_wait) asm volatile("griddepcontrol.wait;" ::: "memory");
    const int chunk = i % n_chunks;
    const int tile = first_tile + (i / n_chunks) * tile_step;
    if (round > 0) bar_wait(empty + 8 * slot, (round - 1) & 1);
    const u32 bytes = min(CHUNK_BLOCKS, n_blocks - chunk * CHUNK_BLOCKS) * BLOCK_BYTES;
    if (lane == 0) bar_expect(full + 8 * slot, ROWS * bytes);
    __syncwarp();
    if (lane < ROWS) {
      const int row = min(tile * ROWS + lane, n_rows - 1);
      bulk_copy(ring + slot * SLOT_BYTES + lane * ROW_STRIDE, W + row * row_bytes + chunk * SEGMENT_BYTES,
                bytes, full + 8 * slot);
    }
    next_slot(slot, round, stages);
  }
}

// Persistent CTAs of 8 consumer warps and one producer warp. CTA c takes the 16-row tiles
// c, c + gridDim.x, ...; a tile streams through a ring of `stages` chunks of 16 rows x 8 blocks.
// The producer moves each chunk as 16 bulk copies of one row's 1152 contiguous bytes
// (cp.async.bulk, counted on the slot's `full` barrier); consumer warp w computes block w of
// every chunk (blocks w, w + 8, ... of the rows, whose x it prepares once) and releases the
// slot on its `empty` barrier, so no warp waits for the others except once per tile.
// Per block, eight m16n8k32 MMAs (two code words per row and lane; the low nibbles against the
// even sub-blocks' x, the high nibbles against the odd ones'): columns 2c and 2c + 1 of B hold
// the high and low bytes of x of one sub-block of chunk c only, so lane (g, t) ends up holding
// both bytes' sums for rows g, g+8 and sub-blocks 2t, 2t+1: the scales it needs are its own
// chunk's. FullChunks: K is a whole number of chunks (every Llama shape), so every warp has a
// block in every chunk and the loop has no branch for the last chunk's missing blocks (14 of
// its 171 instructions in nvcc 13.0's SASS were that branch and its reconvergence).
template <bool FullChunks>
__global__ void __launch_bounds__((WARPS + 1) * 32, MIN_CTAS)
q4k_gemv_b1_kernel(const unsigned char* __restrict__ W, const u16* __restrict__ x, u16* __restrict__ y,
            int n_rows, int n_blocks, int x_is_bf16, int stages, int before_wait) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_chunks = (n_blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  const int n_tiles = (n_rows + ROWS - 1) / ROWS;
  const int my_tiles = (n_tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  const int items = my_tiles * n_chunks;  // (tile, chunk) pairs through the CTA's ring

  unsigned char* xs = smem + stages * SLOT_BYTES;          // [n_blocks][8 sub-blocks][64 B]
  float2* meta = reinterpret_cast<float2*>(xs + n_blocks * 512);  // [n_blocks][8]: unscale, sum
  float* partial = reinterpret_cast<float*>(meta + n_blocks * 8);  // [2][WARPS][16]
  unsigned char* zero_line = reinterpret_cast<unsigned char*>(partial + 2 * WARPS * ROWS);  // 64 B
  const u32 ring = shared_addr(smem);
  const u32 full = shared_addr(zero_line + 64), empty = full + 8 * stages;  // [stages] each

  // Let the next kernel start (if launched as a programmatic dependent, it waits for this
  // one's results itself): under PDL its set-up overlaps this kernel.
  asm volatile("griddepcontrol.launch_dependents;");
  ring_init(zero_line, full, empty, stages, tid);

  if (warp == WARPS) {  // the producer
    produce(W, (long long)n_blocks * BLOCK_BYTES, n_rows, n_blocks, items, n_chunks, stages, before_wait, ring,
            full, empty, lane, (int)blockIdx.x, (int)gridDim.x);
    return;
  }

  // Launched as a programmatic dependent of the kernel before it (the model's norm, attention
  // or SwiGLU), the grid starts while that kernel still runs: the producer streams weights,
  // which nothing writes, and the consumers wait here until x (and y's memory) is theirs. A
  // plain launch returns from the wait at once.
  asm volatile("griddepcontrol.wait;" ::: "memory");

  // x of this warp's blocks, while the weights are in flight, as integers: per sub-block a
  // power-of-two scale puts max |x| in [2^13, 2^14), each value is rounded to an int16 there
  // (bf16 keeps all its bits down to 2^-7 of the sub-block's largest value; the rest round at
  // 2^-14 of it), and the int16 is stored as two signed bytes, so the MMAs run on bytes:
  // x = unscale * (256 hi + lo). Sub-block layout (64 B): the 32 high
  // bytes in order, then the 32 low bytes. The per-sub-block float sum of x serves the min
  // term. Lane l takes values 8 (l % 4) .. + 7 of sub-block l / 4; eight blocks' loads are in
  // flight at once (every block of a warp up to K = 16384): faster than rounds of four under PDL
  // on the H200 (docs/kernels/q4k_gemv.md).
  const int my_blocks = n_blocks > warp ? (n_blocks - warp + WARPS - 1) / WARPS : 0;
  {
    const int s = lane >> 2, part = lane & 3;
    for (int first = 0; first < my_blocks; first += 8) {
      U4 raw[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int b = warp + WARPS * min(first + k, my_blocks - 1);
        raw[k] = *reinterpret_cast<const U4*>(x + b * 256 + s * 32 + part * 8);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (first + k >= my_blocks) break;
        const int b = warp + WARPS * (first + k);
        const XBytes xb = x_as_bytes<true>(raw[k], x_is_bf16);
        unsigned char* sub = xs + (b * 8 + s) * 64 + part * 8;
        *reinterpret_cast<uint2*>(sub) = make_uint2(xb.hi[0], xb.hi[1]);
        *reinterpret_cast<uint2*>(sub + 32) = make_uint2(xb.lo[0], xb.lo[1]);
        if (part == 0) meta[b * 8 + s] = make_float2((s & 1) ? xb.unscale * 0.0625f : xb.unscale, xb.sum);
      }
    }
  }
  __syncwarp();

  // Lane (g, t) with g>>1 == t feeds column g of B: the high bytes (g even) or the low bytes
  // (g odd) of x of sub-block 2t to the low-nibble chain and of sub-block 2t + 1 to the
  // high-nibble chain, each 32 bytes 64 apart; every other lane feeds zeros. The lane's
  // constants stay in registers (opaque): left to itself the compiler rebuilt them in every
  // pass of the loop, ten instructions per block.
  const bool feeds = (g >> 1) == t;
  const u32 x_base = opaque(feeds ? shared_addr(xs) + (g >> 1) * 128 + (g & 1) * 32 : shared_addr(zero_line));
  const u32 x_step = opaque(feeds ? 512u : 0u), x_odd = opaque(feeds ? 64u : 0u);
  const int bsel = (2 * t) & 3;  // byte of the packed 6-bit scale word for sub-block 2t
  const u32 pick_even = opaque(0x7540u | bsel), pick_odd = opaque(0x7540u | (bsel + 1));  // see times_byte
  const u32 codes_g = opaque(g * ROW_STRIDE + 16 + 32 * t), meta_t = opaque(2 * t);

  int slot = 0, round = 0;  // of the ring, as the producer counts them
  for (int tile_iter = 0; tile_iter < my_tiles; ++tile_iter) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
      const int b = chunk * CHUNK_BLOCKS + warp;
      bar_wait(full + 8 * slot, round & 1);
      if (FullChunks || b < n_blocks) {
        const u32 block = ring + slot * SLOT_BYTES + warp * BLOCK_BYTES;
        const u32 row_g = block + g * ROW_STRIDE, row_g8 = block + (g + 8) * ROW_STRIDE;
        const U4 head_g = lds128(row_g), head_g8 = lds128(row_g8);
        U4 q[4];  // this lane's 32 code bytes (chunk t) of rows g and g + 8
        q[0] = lds128(block + codes_g);
        q[1] = lds128(block + codes_g + 16);
        q[2] = lds128(block + codes_g + 8 * ROW_STRIDE);
        q[3] = lds128(block + codes_g + 8 * ROW_STRIDE + 16);
        release_slot(empty, slot, lane);  // the codes are in registers now
        U4 xv[4];  // B fragments: this lane's bytes of x, sub-block 2t then 2t + 1 (or zeros)
        const u32 x_at = x_base + b * x_step;
#pragma unroll
        for (int k = 0; k < 4; ++k) xv[k] = lds128(x_at + (k >> 1) * x_odd + 16 * (k & 1));
        const float2 m0 = meta[b * 8 + meta_t];
        const float2 m1 = meta[b * 8 + meta_t + 1];

        // Per MMA, two code words of each row: the low nibbles (q, masked in place) against
        // the even sub-blocks' x, the high nibbles (16 q) against the odd ones'. Column 2t of
        // each chain sums against the high bytes, column 2t + 1 against the low bytes.
        int even[4] = {}, odd[4] = {};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          // words 2m and 2m + 1 of this lane's codes in rows g and g + 8, and of x's bytes
          const u32 g_0 = (&q[m >> 1].x)[2 * (m & 1)], g_1 = (&q[m >> 1].x)[2 * (m & 1) + 1];
          const u32 g8_0 = (&q[2 + (m >> 1)].x)[2 * (m & 1)], g8_1 = (&q[2 + (m >> 1)].x)[2 * (m & 1) + 1];
          const u32 xe0 = (&xv[m >> 1].x)[2 * (m & 1)], xe1 = (&xv[m >> 1].x)[2 * (m & 1) + 1];
          const u32 xo0 = (&xv[2 + (m >> 1)].x)[2 * (m & 1)], xo1 = (&xv[2 + (m >> 1)].x)[2 * (m & 1) + 1];
          // A's registers: row g, row g + 8 (k 4t..4t+3), then the same rows for k 16+4t..
          const u32 l0 = g_0 & 0x0F0F0F0Fu, l1 = g8_0 & 0x0F0F0F0Fu, l2 = g_1 & 0x0F0F0F0Fu, l3 = g8_1 & 0x0F0F0F0Fu;
          const u32 h0 = g_0 & 0xF0F0F0F0u, h1 = g8_0 & 0xF0F0F0F0u, h2 = g_1 & 0xF0F0F0F0u, h3 = g8_1 & 0xF0F0F0F0u;
          mma_signed(even, l0, l1, l2, l3, xe0, xe1);
          mma_signed(odd, h0, h1, h2, h3, xo0, xo1);
        }
        const float c[4] = {(float)(even[0] * 256 + even[1]), (float)(odd[0] * 256 + odd[1]),
                            (float)(even[2] * 256 + even[3]), (float)(odd[2] * 256 + odd[3])};

        // d * sc and dmin * m for rows g, g+8 and sub-blocks 2t, 2t+1
        float dsc[4], dmm[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const U4 h = r ? head_g8 : head_g;
          const float d = half_to_float((u16)(h.x & 0xFFFFu)), dmin = half_to_float((u16)(h.x >> 16));
          u32 scw, mw;
          if (t < 2) {
            scw = h.y & 0x3F3F3F3Fu;
            mw = h.z & 0x3F3F3F3Fu;
          } else {
            scw = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
            mw = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
          }
          const float minus_d_2_23 = d * -8388608.f, minus_dmin_2_23 = dmin * -8388608.f;
          dsc[2 * r] = times_byte(d, minus_d_2_23, scw, pick_even);
          dsc[2 * r + 1] = times_byte(d, minus_d_2_23, scw, pick_odd);
          dmm[2 * r] = times_byte(dmin, minus_dmin_2_23, mw, pick_even);
          dmm[2 * r + 1] = times_byte(dmin, minus_dmin_2_23, mw, pick_odd);
        }
        acc[0] += dsc[0] * m0.x * c[0] - dmm[0] * m0.y;
        acc[1] += dsc[1] * m1.x * c[1] - dmm[1] * m1.y;
        acc[2] += dsc[2] * m0.x * c[2] - dmm[2] * m0.y;
        acc[3] += dsc[3] * m1.x * c[3] - dmm[3] * m1.y;
      } else {
        release_slot(empty, slot, lane);
      }
      next_slot(slot, round, stages);
    }

    // This tile's rows: lanes t = 0..3 hold a row's sub-blocks 2t, 2t+1; warps hold blocks.
    float top = acc[0] + acc[1], bottom = acc[2] + acc[3];
    top += __shfl_xor_sync(0xFFFFFFFFu, top, 1);
    top += __shfl_xor_sync(0xFFFFFFFFu, top, 2);
    bottom += __shfl_xor_sync(0xFFFFFFFFu, bottom, 1);
    bottom += __shfl_xor_sync(0xFFFFFFFFu, bottom, 2);
    float* sums = partial + (tile_iter & 1) * (WARPS * ROWS);
    if (t == 0) {
      sums[warp * ROWS + g] = top;
      sums[warp * ROWS + g + 8] = bottom;
    }
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");  // the consumers only
    const int row = ((int)blockIdx.x + tile_iter * (int)gridDim.x) * ROWS + tid;
    if (tid < ROWS && row < n_rows) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) total += sums[w * ROWS + tid];
      y[row] = from_float(total, x_is_bf16);
    }
  }
}

// Host side, called from the C++ binding below with PyTorch's current stream.
// The kernel may use up to `max_bytes` of dynamic shared memory (set once: lowering it later
// would make launches that need more fail).
bool q4k_gemv_b1_allow(int max_bytes) {
  const bool ok = cudaFuncSetAttribute(q4k_gemv_b1_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess &&
                  cudaFuncSetAttribute(q4k_gemv_b1_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok;
}

int q4k_gemv_b1_resident(int shared_bytes) {  // CTAs per SM at this shared memory; 0: too big
  int per_sm = 0;
  int partial = 0;  // the smaller of the two builds' occupancies
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, q4k_gemv_b1_kernel<true>, (WARPS + 1) * 32, shared_bytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&partial, q4k_gemv_b1_kernel<false>, (WARPS + 1) * 32, shared_bytes);
  return per_sm < partial ? per_sm : partial;
}

// `dependent`: launch with programmatic stream serialization, so the grid may start before
// the previous kernel in the stream ends (it waits for it before touching x and y).
static cudaLaunchConfig_t launch_config(int grid, int shared_bytes, int dependent, cudaStream_t stream,
                                        cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3((WARPS + 1) * 32);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute->val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  return config;
}

bool q4k_gemv_b1_launch(const void* W, const void* x, void* y, int n_rows, int n_blocks,
                        int x_is_bf16, int stages, int before_wait, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(grid, shared_bytes, dependent, stream, &attribute);
  return cudaLaunchKernelEx(&config,
                            n_blocks % CHUNK_BLOCKS == 0 ? q4k_gemv_b1_kernel<true> : q4k_gemv_b1_kernel<false>,
                            static_cast<const unsigned char*>(W),
                            static_cast<const u16*>(x), static_cast<u16*>(y), n_rows, n_blocks,
                            x_is_bf16, stages, before_wait) == cudaSuccess;
}

// ---- Batches 2-8: one launch reads the weight once for every row of x. ----
// The same persistent CTAs, producer warp and ring as above. What changes is the MMA's use:
// its k runs inside one sub-block and its 8 columns are the rows of x. A dot product's terms may
// be taken in any order, so lane t holds codes 8t .. 8t+7 of a sub-block in A (one 8-byte load
// per row) and the same eight values of x in B. Lane (g, t) then ends up with rows g and g + 8
// of y for x rows 2t and 2t + 1, per sub-block, and every column is useful: 16 MMAs per block
// serve up to 8 rows of x, as they serve one at batch 1.
// x in shared memory, per block b, sub-block s, row n of x: 64 B, for t = 0..3 the 8 high
// bytes then the 8 low bytes of values 8t .. 8t+7 (one 16-byte load per lane and sub-block);
// meta per (b, s, n): (unscale, sum of x), with the high-nibble sub-blocks' 1/16 folded in.
// Where x of every row does not leave room for two CTAs per SM (K = 14336 from batch 2), K is
// cut into `k_parts` runs of whole chunks: CTA c works on part c % k_parts only (x of that part
// only, and its tiles c / k_parts, + gridDim.x / k_parts, ...), and writes float sums per part
// into `parts` [k_parts][batch][n_rows], which q4k_sum_parts_kernel adds in part order into y.
#define MAX_BATCH 8
__device__ __forceinline__ uint2 lds64(u32 addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__global__ void __launch_bounds__((WARPS + 1) * 32, 2)
q4k_gemv_bn_kernel(const unsigned char* __restrict__ W, const u16* __restrict__ x, u16* __restrict__ y,
                   float* __restrict__ parts, int n_rows, int k_blocks, int batch, int x_is_bf16, int stages,
                   int k_parts) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // This CTA's part of K: chunks first_chunk .. + n_chunks - 1, blocks block0 .. + n_blocks - 1
  const int my_part = (int)blockIdx.x % k_parts, ctas = (int)gridDim.x / k_parts, cta = (int)blockIdx.x / k_parts;
  const int all_chunks = (k_blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  const int part_chunks = (all_chunks + k_parts - 1) / k_parts;
  const int first_chunk = my_part * part_chunks;
  const int n_chunks = max(min(part_chunks, all_chunks - first_chunk), 0);  // > 0: the host cuts no empty part
  const int block0 = first_chunk * CHUNK_BLOCKS;
  const int n_blocks = max(min(part_chunks * CHUNK_BLOCKS, k_blocks - block0), 0);
  const int n_tiles = (n_rows + ROWS - 1) / ROWS;
  const int my_tiles = n_chunks > 0 ? (n_tiles - cta + ctas - 1) / ctas : 0;
  const int items = my_tiles * n_chunks;
  const int K = k_blocks * 256;

  unsigned char* xs = smem + stages * SLOT_BYTES;                        // [n_blocks][8][batch][64 B]
  float2* meta = reinterpret_cast<float2*>(xs + n_blocks * 8 * batch * 64);  // [n_blocks][8][batch]
  float* partial = reinterpret_cast<float*>(meta + n_blocks * 8 * batch);    // [2][WARPS][ROWS][MAX_BATCH]
  unsigned char* zero_line = reinterpret_cast<unsigned char*>(partial + 2 * WARPS * ROWS * MAX_BATCH);
  const u32 ring = shared_addr(smem);
  const u32 full = shared_addr(zero_line + 64), empty = full + 8 * stages;

  asm volatile("griddepcontrol.launch_dependents;");
  ring_init(zero_line, full, empty, stages, tid);

  if (warp == WARPS) {  // the producer, as at batch 1, its whole ring ahead of the kernel before
    produce(W + (long long)block0 * BLOCK_BYTES, (long long)k_blocks * BLOCK_BYTES, n_rows, n_blocks, items,
            n_chunks, stages, items, ring, full, empty, lane, cta, ctas);
    return;
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");

  // x as integers, as at batch 1 (per sub-block a power of two puts max |x| in [2^13, 2^14)),
  // for every row of x: lane l makes values 8 (l % 4) .. + 7 of sub-block l / 4 of a block.
  {
    const int s = lane >> 2, part = lane & 3;
    for (int n = 0; n < batch; ++n) {
      for (int b = warp; b < n_blocks; b += WARPS) {
        const U4 raw = *reinterpret_cast<const U4*>(x + (long long)n * K + (block0 + b) * 256 + s * 32 + part * 8);
        const XBytes xb = x_as_bytes<false>(raw, x_is_bf16);
        const int at = (b * 8 + s) * batch + n;
        *reinterpret_cast<U4*>(xs + at * 64 + part * 16) = U4{xb.hi[0], xb.hi[1], xb.lo[0], xb.lo[1]};
        if (part == 0) meta[at] = make_float2((s & 1) ? xb.unscale * 0.0625f : xb.unscale, xb.sum);
      }
    }
  }
  __syncwarp();  // a warp computes the blocks whose x it made (b = warp mod 8), as at batch 1

  // Lane (g, t) feeds column g of B (row g of x), zeros past the batch; it reads the (unscale,
  // sum) of x rows 2t and 2t + 1 for its outputs (zeros past the batch, whose outputs are
  // never stored).
  const bool feeds = g < batch;
  const int n0 = min(2 * t, batch - 1), n1 = min(2 * t + 1, batch - 1);
  const u32 x_lane = shared_addr(xs) + g * 64 + t * 16;
  const u32 zeros = shared_addr(zero_line) + t * 16;

  int slot = 0, round = 0;
  for (int tile_iter = 0; tile_iter < my_tiles; ++tile_iter) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g | g+8, g+8 x rows of x 2t, 2t+1
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
      const int b = chunk * CHUNK_BLOCKS + warp;
      bar_wait(full + 8 * slot, round & 1);
      if (b < n_blocks) {
        const u32 block = ring + slot * SLOT_BYTES + warp * BLOCK_BYTES;
        const u32 row_g = block + g * ROW_STRIDE, row_g8 = block + (g + 8) * ROW_STRIDE;
        const U4 head_g = lds128(row_g), head_g8 = lds128(row_g8);
        uint2 code_g[4], code_g8[4];  // codes 8t .. 8t+7 of each sub-block pair, rows g and g + 8
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          code_g[j] = lds64(row_g + 16 + 32 * j + 8 * t);
          code_g8[j] = lds64(row_g8 + 16 + 32 * j + 8 * t);
        }
        release_slot(empty, slot, lane);

        // rows g and g + 8: d, dmin, and the packed 6-bit scales and mins of sub-blocks 0-3, 4-7
        float d[2], dmin[2], minus_d_2_23[2], minus_dmin_2_23[2];  // see times_byte
        u32 sc_w[2][2], m_w[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const U4 h = r ? head_g8 : head_g;
          d[r] = half_to_float((u16)(h.x & 0xFFFFu));
          dmin[r] = half_to_float((u16)(h.x >> 16));
          minus_d_2_23[r] = d[r] * -8388608.f;
          minus_dmin_2_23[r] = dmin[r] * -8388608.f;
          sc_w[r][0] = h.y & 0x3F3F3F3Fu;
          m_w[r][0] = h.z & 0x3F3F3F3Fu;
          sc_w[r][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
          m_w[r][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
        }

#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // sub-block 2j from the low nibbles, 2j + 1 from the high ones (16 q; the 1/16 is in meta)
          const u32 l0 = code_g[j].x & 0x0F0F0F0Fu, l1 = code_g8[j].x & 0x0F0F0F0Fu;
          const u32 l2 = code_g[j].y & 0x0F0F0F0Fu, l3 = code_g8[j].y & 0x0F0F0F0Fu;
          const u32 h0 = code_g[j].x & 0xF0F0F0F0u, h1 = code_g8[j].x & 0xF0F0F0F0u;
          const u32 h2 = code_g[j].y & 0xF0F0F0F0u, h3 = code_g8[j].y & 0xF0F0F0F0u;
#pragma unroll
          for (int odd = 0; odd < 2; ++odd) {
            const int s = 2 * j + odd;
            const int at = (b * 8 + s) * batch;  // (b, s, row 0 of x)
            const U4 xv = lds128(feeds ? x_lane + at * 64 : zeros);  // high x high, low x low
            int hi[4] = {}, lo[4] = {};
            if (odd) {
              mma_signed(hi, h0, h1, h2, h3, xv.x, xv.y);
              mma_unsigned(lo, h0, h1, h2, h3, xv.z, xv.w);
            } else {
              mma_signed(hi, l0, l1, l2, l3, xv.x, xv.y);
              mma_unsigned(lo, l0, l1, l2, l3, xv.z, xv.w);
            }
            const float2 m0 = meta[at + n0], m1 = meta[at + n1];
            const u32 pick = 0x7540u | (s & 3);
            const float dsc0 = times_byte(d[0], minus_d_2_23[0], sc_w[0][s >> 2], pick);
            const float dmm0 = times_byte(dmin[0], minus_dmin_2_23[0], m_w[0][s >> 2], pick);
            const float dsc1 = times_byte(d[1], minus_d_2_23[1], sc_w[1][s >> 2], pick);
            const float dmm1 = times_byte(dmin[1], minus_dmin_2_23[1], m_w[1][s >> 2], pick);
            // two FMAs per output where an FMUL, an FFMA and an FADD were (a different rounding
            // from the batch-1 kernel's, as precise)
            acc[0] = fmaf(-dmm0, m0.y, fmaf(dsc0 * m0.x, (float)(hi[0] * 256 + lo[0]), acc[0]));
            acc[1] = fmaf(-dmm0, m1.y, fmaf(dsc0 * m1.x, (float)(hi[1] * 256 + lo[1]), acc[1]));
            acc[2] = fmaf(-dmm1, m0.y, fmaf(dsc1 * m0.x, (float)(hi[2] * 256 + lo[2]), acc[2]));
            acc[3] = fmaf(-dmm1, m1.y, fmaf(dsc1 * m1.x, (float)(hi[3] * 256 + lo[3]), acc[3]));
          }
        }
      } else {
        release_slot(empty, slot, lane);
      }
      next_slot(slot, round, stages);
    }

    // Across warps (blocks): partial[buffer][warp][row][n], then one thread per (row, n).
    float* sums = partial + (tile_iter & 1) * (WARPS * ROWS * MAX_BATCH);
    sums[(warp * ROWS + g) * MAX_BATCH + 2 * t] = acc[0];
    sums[(warp * ROWS + g) * MAX_BATCH + 2 * t + 1] = acc[1];
    sums[(warp * ROWS + g + 8) * MAX_BATCH + 2 * t] = acc[2];
    sums[(warp * ROWS + g + 8) * MAX_BATCH + 2 * t + 1] = acc[3];
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
    const int r = tid / MAX_BATCH, n = tid % MAX_BATCH;  // 128 of the 256 consumer threads
    // (the CTA's place, from blockIdx again: registers are short in the loop above)
    const int row = ((int)blockIdx.x / k_parts + tile_iter * ((int)gridDim.x / k_parts)) * ROWS + r;
    if (tid < ROWS * MAX_BATCH && n < batch && row < n_rows) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) total += sums[(w * ROWS + r) * MAX_BATCH + n];
      if (k_parts == 1) {
        y[(long long)n * n_rows + row] = from_float(total, x_is_bf16);
      } else {
        parts[((long long)((int)blockIdx.x % k_parts) * batch + n) * n_rows + row] = total;
      }
    }
  }
}

// y = the parts' sums added in part order (the same bits however the CTAs ran), as a
// programmatic dependent of the batched kernel: it starts while that kernel ends.
__global__ void q4k_sum_parts_kernel(const float* __restrict__ parts, u16* __restrict__ y, int count, int k_parts,
                                     int x_is_bf16) {
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    float total = parts[i];
    for (int p = 1; p < k_parts; ++p) total += parts[(long long)p * count + i];
    y[i] = from_float(total, x_is_bf16);
  }
}

bool q4k_gemv_bn_allow(int max_bytes) {
  const bool ok = cudaFuncSetAttribute(q4k_gemv_bn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok;
}

int q4k_gemv_bn_resident(int shared_bytes) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, q4k_gemv_bn_kernel, (WARPS + 1) * 32, shared_bytes);
  return per_sm;
}

// `grid`: a multiple of k_parts; `parts`: k_parts * batch * n_rows floats where k_parts > 1.
bool q4k_gemv_bn_launch(const void* W, const void* x, void* y, void* parts, int n_rows, int n_blocks, int batch,
                        int x_is_bf16, int stages, int k_parts, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(grid, shared_bytes, dependent, stream, &attribute);
  if (cudaLaunchKernelEx(&config, q4k_gemv_bn_kernel, static_cast<const unsigned char*>(W),
                         static_cast<const u16*>(x), static_cast<u16*>(y), static_cast<float*>(parts), n_rows,
                         n_blocks, batch, x_is_bf16, stages, k_parts) != cudaSuccess)
    return false;
  if (k_parts == 1) return true;
  const int count = batch * n_rows, threads = 256;
  cudaLaunchAttribute sum_attribute;
  cudaLaunchConfig_t sum_config = launch_config(min((count + threads - 1) / threads, 1024), 0, 1, stream,
                                                &sum_attribute);
  sum_config.blockDim = dim3(threads);
  return cudaLaunchKernelEx(&sum_config, q4k_sum_parts_kernel, static_cast<const float*>(parts),
                            static_cast<u16*>(y), count, k_parts, x_is_bf16) == cudaSuccess;
}
