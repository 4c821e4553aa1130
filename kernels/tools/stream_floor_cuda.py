#!/usr/bin/env python3
"""Streaming floors of the Q4_K GEMV's CUDA structure, on a GPU (sm_90).

    python kernels/tools/stream_floor_cuda.py        # writes $OUT/stream_floor_cuda.json

The q4k_gemv CUDA kernel streams weights with a producer warp (bulk copies into a ring of
shared-memory slots, full/empty mbarriers) and eight consumer warps. This kernel keeps exactly
that and drops the arithmetic: consumers read one word per chunk and release it. It times the
Llama-3-8B GEMV byte counts as 16 strided row segments per chunk (the GEMV's layout) and as
flat contiguous pieces, by piece size, ring slots and CTAs per SM, the way kernels/tools/sweep_q4k.py
times kernels (L2-cold rotating buffers, one CUDA graph). The gap between these floors and the
GEMV is what its arithmetic costs.
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_q4k import time_rotating  # noqa: E402

SRC = r"""
#include <cuda_runtime.h>
typedef unsigned int u32;
__device__ __forceinline__ u32 sa(const void* p){u32 a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }":"=r"(a):"l"(p)); return a;}
__device__ __forceinline__ void binit(u32 b,u32 c){asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"::"r"(b),"r"(c):"memory");}
__device__ __forceinline__ void bexp(u32 b,u32 n){asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"::"r"(b),"r"(n):"memory");}
__device__ __forceinline__ void barr(u32 b){asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"::"r"(b):"memory");}
__device__ __forceinline__ void bwait(u32 b,u32 p){asm volatile("{ .reg .pred d; W_%=: mbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1; @!d bra W_%=; }"::"r"(b),"r"(p):"memory");}
__device__ __forceinline__ void bulk(u32 d,const void* s,u32 n,u32 b){asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"::"r"(d),"l"(s),"r"(n),"r"(b):"memory");}
// pieces: n_items items of `rows` segments of `seg` bytes; segment r of item i at base + i_row0*stride + r*stride + i_col*seg
__global__ void __launch_bounds__(288) stream(const unsigned char* W, float* out, int n_items, int rows, int seg, long long stride, int items_per_rowgroup, int stages){
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp=threadIdx.x>>5, lane=threadIdx.x&31;
  const int slot_bytes = rows*seg;
  u32 full=sa(smem+stages*slot_bytes), empty=full+8*stages;
  if(threadIdx.x<stages){binit(full+8*threadIdx.x,1); binit(empty+8*threadIdx.x,8);}
  asm volatile("fence.mbarrier_init.release.cluster;":::"memory");
  __syncthreads();
  const int mine=(n_items-(int)blockIdx.x+(int)gridDim.x-1)/(int)gridDim.x;
  if(warp==8){
    for(int i=0;i<mine;++i){
      int s=i%stages, item=blockIdx.x+i*gridDim.x;
      if(i>=stages) bwait(empty+8*s,((i/stages)-1)&1);
      if(lane==0) bexp(full+8*s,slot_bytes);
      __syncwarp();
      int rg=item/items_per_rowgroup, col=item%items_per_rowgroup;
      for(int r=lane;r<rows;r+=32) bulk(sa(smem)+s*slot_bytes+r*seg, W+((long long)rg*rows+r)*stride+(long long)col*seg, seg, full+8*s);
    }
    return;
  }
  float acc=0.f;
  for(int i=0;i<mine;++i){int s=i%stages; bwait(full+8*s,(i/stages)&1); acc+=((float*)(smem+s*slot_bytes))[warp*32+lane]; __syncwarp(); if(lane==0) barr(empty+8*s);}
  if(acc==12345.f) out[0]=acc;  // keeps the reads
}

void run(const void* W, void* out, int n_items, int rows, int seg, long long stride, int ipr, int stages, int grid, cudaStream_t st){
  int smem=stages*rows*seg+16*stages;
  cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 200*1024);
  stream<<<grid,288,smem,st>>>((const unsigned char*)W,(float*)out,n_items,rows,seg,stride,ipr,stages);
}
"""
CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
void run(const void* W, void* out, int n_items, int rows, int seg, long long stride, int ipr, int stages, int grid, cudaStream_t st);
void go(torch::Tensor w, torch::Tensor out, int64_t n_items, int64_t rows, int64_t seg, int64_t stride, int64_t ipr, int64_t stages, int64_t grid){
  run(w.data_ptr(), out.data_ptr(), n_items, rows, seg, stride, ipr, stages, grid, c10::cuda::getCurrentCUDAStream().stream());
}
"""
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # GEMV rows x K, Q4_K: 144 B per 256


def configurations(n: int, row_bytes: int) -> list[tuple]:
    """(kind, rows per piece, bytes per segment, segment stride, pieces per row group, pieces)."""
    total = n * row_bytes
    found = []
    for seg in (1152, 2304, 4032):
        if row_bytes % seg == 0:
            per_row = row_bytes // seg
            found.append(("strided16", 16, seg, row_bytes, per_row, n // 16 * per_row))
    for piece in (18432, 36864, 65536):
        if total % piece == 0:
            found.append(("flat", 1, piece, piece, 1, total // piece))
    return found


def main() -> int:
    module = load_inline(
        "loom_stream_floor",
        CPP,
        SRC,
        functions=["go"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(1, device="cuda")
    rows_out = []
    for n, k in SHAPES:
        row_bytes = k // 256 * 144
        total = n * row_bytes
        count = max(4, 3 * 60 * 2**20 // total + 1)  # rotating buffers: 3x the L2
        sets = [(torch.empty(total, dtype=torch.uint8, device="cuda"),) for _ in range(count)]
        for kind, rows, seg, stride, per_row, items in configurations(n, row_bytes):
            for stages in (2, 4):
                for per_sm in (1, 2):
                    if stages * rows * seg > 200 * 1024 or per_sm * (stages * rows * seg + 2048) > 227 * 1024:
                        continue
                    grid = min(items, per_sm * sms)

                    def stream(w, args=(items, rows, seg, stride, per_row, stages, grid)):
                        return module.go(w, out, *args)

                    med, _, _ = time_rotating(stream, sets, replays=20)
                    line = {"shape": [n, k], "kind": kind, "seg": seg, "stages": stages,
                            "per_sm": per_sm, "us": round(med * 1e6, 2),
                            "tb_s": round(total / med / 1e12, 2)}
                    rows_out.append(line)
                    print(json.dumps(line), flush=True)
        del sets
        torch.cuda.empty_cache()
    target = Path(os.environ.get("OUT", "."))
    target.mkdir(parents=True, exist_ok=True)
    (target / "stream_floor_cuda.json").write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
