// ---- Batch 1 with dynamic work units (experiment) ----
// A unit is (tile, part): part p covers chunks [p * unit_chunks, (p + 1) * unit_chunks) of the
// tile's 16 rows. CTA c streams unit c first (before the kernel ahead ends, under PDL); later
// units come from a counter in `work`, so CTAs that start late (behind the previous launch's
// last CTAs) take fewer. A tile in several parts is summed in part order by whichever CTA ends
// its last part: the bits do not depend on which CTA did what. `work`: int next, int done,
// int tile_count[n_tiles], float partial[units][16]; zero before the first launch, and every
// launch leaves it zero again.
#define END_OF_WORK 0x7FFFFFFF

__device__ __forceinline__ void produce_unit(const unsigned char* __restrict__ W, int n_rows, int n_blocks,
                                             int n_chunks, int unit_chunks, int parts, int unit, int stages,
                                             u32 ring, u32 full, u32 empty, int2* info, int& slot, int& round,
                                             int lane) {
  const long long row_bytes = (long long)n_blocks * BLOCK_BYTES;
  const int tile = unit / parts, part = unit - tile * parts;
  const int c0 = part * unit_chunks, c1 = min(c0 + unit_chunks, n_chunks);
  for (int chunk = c0; chunk < c1; ++chunk) {
    if (round > 0) bar_wait(empty + 8 * slot, (round - 1) & 1);
    const u32 bytes = min(CHUNK_BLOCKS, n_blocks - chunk * CHUNK_BLOCKS) * BLOCK_BYTES;
    if (lane == 0) {
      info[slot] = make_int2(unit, chunk);
      bar_expect(full + 8 * slot, ROWS * bytes);
    }
    __syncwarp();
    if (lane < ROWS) {
      const int row = min(tile * ROWS + lane, n_rows - 1);
      bulk_copy(ring + slot * SLOT_BYTES + lane * ROW_STRIDE, W + row * row_bytes + chunk * SEGMENT_BYTES,
                bytes, full + 8 * slot);
    }
    if (++slot == stages) slot = 0, ++round;
  }
}

__global__ void __launch_bounds__((WARPS + 1) * 32, MIN_CTAS)
q4k_gemv_dyn_kernel(const unsigned char* __restrict__ W, const u16* __restrict__ x, u16* __restrict__ y,
                    int* __restrict__ work, int n_rows, int n_blocks, int x_is_bf16, int stages, int unit_chunks) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_chunks = (n_blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  const int n_tiles = (n_rows + ROWS - 1) / ROWS;
  const int parts = (n_chunks + unit_chunks - 1) / unit_chunks;
  const int units = n_tiles * parts;
  int* tile_count = work + 2;
  float* partial_sums = reinterpret_cast<float*>(work + 2 + n_tiles);  // [units][ROWS]

  unsigned char* xs = smem + stages * SLOT_BYTES;
  float2* meta = reinterpret_cast<float2*>(xs + n_blocks * 512);
  float* partial = reinterpret_cast<float*>(meta + n_blocks * 8);
  unsigned char* zero_line = reinterpret_cast<unsigned char*>(partial + 2 * WARPS * ROWS);
  const u32 ring = shared_addr(smem);
  const u32 full = shared_addr(zero_line + 64), empty = full + 8 * stages;
  int2* info = reinterpret_cast<int2*>(zero_line + 64 + 16 * stages);  // [stages]: (unit, chunk)

  asm volatile("griddepcontrol.launch_dependents;");
  ring_init(zero_line, full, empty, stages, tid);

  if (warp == WARPS) {  // the producer
    int slot = 0, round = 0, unit = blockIdx.x;
    if (unit < units)
      produce_unit(W, n_rows, n_blocks, n_chunks, unit_chunks, parts, unit, stages, ring, full, empty, info, slot,
                   round, lane);
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the counters are this launch's from here
    int ticket = 0;
    if (lane == 0 && unit < units) ticket = atomicAdd(work, 1);
    while (unit < units) {
      unit = __shfl_sync(0xFFFFFFFFu, ticket, 0) + (int)gridDim.x;
      if (unit >= units) break;
      if (lane == 0) ticket = atomicAdd(work, 1);  // the next unit's, in flight while this one streams
      produce_unit(W, n_rows, n_blocks, n_chunks, unit_chunks, parts, unit, stages, ring, full, empty, info, slot,
                   round, lane);
    }
    if (round > 0) bar_wait(empty + 8 * slot, (round - 1) & 1);
    if (lane == 0) {
      info[slot] = make_int2(END_OF_WORK, 0);
      bar_arrive(full + 8 * slot);
      // the last CTA done taking units leaves the counters zero for the next launch
      if (atomicAdd(work + 1, 1) == (int)gridDim.x - 1) {
        work[0] = 0;
        work[1] = 0;
      }
    }
    return;
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");
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
        const XBytes xb = x_as_bytes(raw[k], x_is_bf16);
        unsigned char* sub = xs + (b * 8 + s) * 64 + part * 8;
        *reinterpret_cast<uint2*>(sub) = make_uint2(xb.hi[0], xb.hi[1]);
        *reinterpret_cast<uint2*>(sub + 32) = make_uint2(xb.lo[0], xb.lo[1]);
        if (part == 0) meta[b * 8 + s] = make_float2((s & 1) ? xb.unscale * 0.0625f : xb.unscale, xb.sum);
      }
    }
  }
  __syncwarp();

  const bool feeds = (g >> 1) == t;
  const u32 x_base = feeds ? shared_addr(xs) + g * 64 : shared_addr(zero_line);
  const u32 x_step = feeds ? 512u : 0u;
  const int bsel = (2 * t) & 3;
  const u32 pick_even = 0x7540u | bsel, pick_odd = 0x7540u | (bsel + 1);

  int slot = 0, round = 0, units_done = 0;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (;;) {
    bar_wait(full + 8 * slot, round & 1);
    const int2 item = info[slot];
    if (item.x == END_OF_WORK) break;
    const int unit = item.x, chunk = item.y;
    const int b = chunk * CHUNK_BLOCKS + warp;
    if (b < n_blocks) {
      const u32 block = ring + slot * SLOT_BYTES + warp * BLOCK_BYTES;
      const u32 row_g = block + g * ROW_STRIDE, row_g8 = block + (g + 8) * ROW_STRIDE;
      const U4 head_g = lds128(row_g), head_g8 = lds128(row_g8);
      U4 q[4];
      q[0] = lds128(row_g + 16 + 32 * t);
      q[1] = lds128(row_g + 32 + 32 * t);
      q[2] = lds128(row_g8 + 16 + 32 * t);
      q[3] = lds128(row_g8 + 32 + 32 * t);
      __syncwarp();
      if (lane == 0) bar_arrive(empty + 8 * slot);
      U4 xv[4];
      const u32 x_at = x_base + b * x_step;
#pragma unroll
      for (int k = 0; k < 4; ++k) xv[k] = lds128(x_at + 16 * k);
      const float2 m0 = meta[b * 8 + 2 * t];
      const float2 m1 = meta[b * 8 + 2 * t + 1];
      int lo_hi[4] = {}, lo_lo[4] = {}, hi_hi[4] = {}, hi_lo[4] = {};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const u32 g_0 = (&q[m >> 1].x)[2 * (m & 1)], g_1 = (&q[m >> 1].x)[2 * (m & 1) + 1];
        const u32 g8_0 = (&q[2 + (m >> 1)].x)[2 * (m & 1)], g8_1 = (&q[2 + (m >> 1)].x)[2 * (m & 1) + 1];
        const u32 xh0 = (&xv[m >> 1].x)[2 * (m & 1)], xh1 = (&xv[m >> 1].x)[2 * (m & 1) + 1];
        const u32 xl0 = (&xv[2 + (m >> 1)].x)[2 * (m & 1)], xl1 = (&xv[2 + (m >> 1)].x)[2 * (m & 1) + 1];
        const u32 l0 = g_0 & 0x0F0F0F0Fu, l1 = g8_0 & 0x0F0F0F0Fu, l2 = g_1 & 0x0F0F0F0Fu, l3 = g8_1 & 0x0F0F0F0Fu;
        const u32 h0 = g_0 & 0xF0F0F0F0u, h1 = g8_0 & 0xF0F0F0F0u, h2 = g_1 & 0xF0F0F0F0u, h3 = g8_1 & 0xF0F0F0F0u;
        mma_signed(lo_hi, l0, l1, l2, l3, xh0, xh1);
        mma_unsigned(lo_lo, l0, l1, l2, l3, xl0, xl1);
        mma_signed(hi_hi, h0, h1, h2, h3, xh0, xh1);
        mma_unsigned(hi_lo, h0, h1, h2, h3, xl0, xl1);
      }
      const float c[4] = {(float)(lo_hi[0] * 256 + lo_lo[0]), (float)(hi_hi[1] * 256 + hi_lo[1]),
                          (float)(lo_hi[2] * 256 + lo_lo[2]), (float)(hi_hi[3] * 256 + hi_lo[3])};
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
        dsc[2 * r] = d * byte_to_float(scw, pick_even);
        dsc[2 * r + 1] = d * byte_to_float(scw, pick_odd);
        dmm[2 * r] = dmin * byte_to_float(mw, pick_even);
        dmm[2 * r + 1] = dmin * byte_to_float(mw, pick_odd);
      }
      acc[0] += dsc[0] * m0.x * c[0] - dmm[0] * m0.y;
      acc[1] += dsc[1] * m1.x * c[1] - dmm[1] * m1.y;
      acc[2] += dsc[2] * m0.x * c[2] - dmm[2] * m0.y;
      acc[3] += dsc[3] * m1.x * c[3] - dmm[3] * m1.y;
    } else {
      __syncwarp();
      if (lane == 0) bar_arrive(empty + 8 * slot);
    }
    if (++slot == stages) slot = 0, ++round;

    const int tile = unit / parts, part = unit - tile * parts;
    if (chunk != min((part + 1) * unit_chunks, n_chunks) - 1) continue;
    // The unit's last chunk: its 16 rows' sums over the warps (blocks), in warp order.
    float top = acc[0] + acc[1], bottom = acc[2] + acc[3];
    top += __shfl_xor_sync(0xFFFFFFFFu, top, 1);
    top += __shfl_xor_sync(0xFFFFFFFFu, top, 2);
    bottom += __shfl_xor_sync(0xFFFFFFFFu, bottom, 1);
    bottom += __shfl_xor_sync(0xFFFFFFFFu, bottom, 2);
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    float* sums = partial + (units_done & 1) * (WARPS * ROWS);
    ++units_done;
    if (t == 0) {
      sums[warp * ROWS + g] = top;
      sums[warp * ROWS + g + 8] = bottom;
    }
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
    if (warp != 0) continue;
    const int row = tile * ROWS + lane;
    float total = 0.f;
    if (lane < ROWS) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) total += sums[w * ROWS + lane];
    }
    if (parts == 1) {
      if (lane < ROWS && row < n_rows) y[row] = from_float(total, x_is_bf16);
      continue;
    }
    if (lane < ROWS) partial_sums[unit * ROWS + lane] = total;
    __threadfence();
    __syncwarp();
    int arrived = 0;
    if (lane == 0) arrived = atomicAdd(tile_count + tile, 1);
    arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
    if (arrived != parts - 1) continue;
    __threadfence();  // the other parts' sums, written before their arrivals, are visible
    if (lane < ROWS && row < n_rows) {
      float sum = 0.f;
      for (int p = 0; p < parts; ++p) sum += __ldcg(partial_sums + (tile * parts + p) * ROWS + lane);
      y[row] = from_float(sum, x_is_bf16);
    }
    if (lane == 0) tile_count[tile] = 0;
  }
}

bool q4k_gemv_dyn_allow(int max_bytes) {
  const bool ok = cudaFuncSetAttribute(q4k_gemv_dyn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok;
}

bool q4k_gemv_dyn_launch(const void* W, const void* x, void* y, void* work, int n_rows, int n_blocks,
                         int x_is_bf16, int stages, int unit_chunks, int grid, int shared_bytes, int dependent,
                         cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(grid, shared_bytes, dependent, stream, &attribute);
  return cudaLaunchKernelEx(&config, q4k_gemv_dyn_kernel, static_cast<const unsigned char*>(W),
                            static_cast<const u16*>(x), static_cast<u16*>(y), static_cast<int*>(work), n_rows,
                            n_blocks, x_is_bf16, stages, unit_chunks) == cudaSuccess;
}
