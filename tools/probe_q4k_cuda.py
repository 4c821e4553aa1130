#!/usr/bin/env python3
"""Time a hand-written CUDA Q4_K GEMV against the kernel in kernels/q4k_gemv, on a GPU.

    python tools/probe_q4k_cuda.py [--source tools/q4k_gemv_cuda.cu] [--threads 256] [--ctas-per-sm 0]

The .cu file is built with nvcc to a cubin for this GPU, loaded with the CUDA driver API through
ctypes (no extension build, no ninja), and launched on torch's current stream, so CUDA-graph
capture records it like any other kernel. The kernel's contract: `extern "C" __global__ void
q4k_gemv_b1(const uint4* W, const bf16* x, bf16* y, int n_rows, int n_blocks)`, batch 1, dynamic
shared memory of n_blocks * 268 * 4 bytes. Timing is tools/sweep_q4k.py's: L2-cold rotating
weights, one CUDA graph, median and P10/P90 over replays. Each result is checked against the naive
GEMV (kernels/q4k_gemv/baseline.py) before it is timed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_q4k import REPO, load, rotating_sets, time_rotating  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]
SMEM_FLOATS_PER_BLOCK = 268  # the kernel's padded x (260) and per-sub-block sums (8)


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


class CudaGemv:
    """The cubin's q4k_gemv_b1, launched through the driver API."""

    def __init__(self, cubin: bytes, threads: int, ctas_per_sm: int) -> None:
        torch.empty(1, device="cuda")  # torch's primary context becomes current on this thread
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._keep = ctypes.create_string_buffer(cubin)
        check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), self._keep), "cuModuleLoadData")
        check(
            self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), self.module, b"q4k_gemv_b1"),
            "cuModuleGetFunction",
        )
        # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: x for K = 14336 needs about 60 KB
        check(self.cuda.cuFuncSetAttribute(self.fn, 8, 200 * 1024), "cuFuncSetAttribute")
        self.threads, self.ctas_per_sm = threads, ctas_per_sm
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.grids: dict[int, int] = {}

    def grid(self, n_blocks: int, smem: int) -> int:
        if n_blocks not in self.grids:
            per_sm = ctypes.c_int()
            check(
                self.cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(per_sm), self.fn, self.threads, ctypes.c_size_t(smem)
                ),
                "occupancy",
            )
            self.grids[n_blocks] = self.sms * (self.ctas_per_sm or per_sm.value)
        return self.grids[n_blocks]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        assert x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.is_contiguous()
        n_rows, n_blocks = weight.shape[0], weight.shape[1] // 144
        out = torch.empty((1, n_rows), dtype=x.dtype, device=x.device)
        smem = n_blocks * SMEM_FLOATS_PER_BLOCK * 4
        warps_per_cta = self.threads // 32
        grid = min(self.grid(n_blocks, smem), -(-n_rows // warps_per_cta))
        args = [
            ctypes.c_void_p(weight.data_ptr()),
            ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int(n_rows),
            ctypes.c_int(n_blocks),
        ]
        params = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args]
        )
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(
            self.cuda.cuLaunchKernel(
                self.fn, grid, 1, 1, self.threads, 1, 1, smem, stream, params, None
            ),
            "cuLaunchKernel",
        )
        return out


def build(source: Path) -> bytes:
    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        subprocess.run(
            [
                "nvcc",
                "-cubin",
                f"-arch=sm_{major}{minor}",
                "-O3",
                "-Xptxas",
                "-v",
                "-o",
                str(cubin),
                str(source),
            ],
            check=True,
        )
        return cubin.read_bytes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).with_name("q4k_gemv_cuda.cu"))
    parser.add_argument("--threads", type=int, default=256)
    parser.add_argument("--ctas-per-sm", type=int, default=0, help="0: as many as fit")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    task = load(REPO / "kernels/q4k_gemv/task.py", "cuda_probe_task")
    base = load(REPO / "kernels/q4k_gemv/baseline.py", "cuda_probe_base")
    cand = load(REPO / "kernels/q4k_gemv/candidate.py", "cuda_probe_cand")
    cuda_gemv = CudaGemv(build(args.source), args.threads, args.ctas_per_sm)
    rows = []
    for n, k in SHAPES:

        def make(n=n, k=k):
            x, w = task.get_inputs(batch=1, n=n, k=k)
            return x.cuda(), w.cuda()

        sets = rotating_sets(make, n * k // 256 * 144)
        x0, w0 = sets[0]
        expected = base.ModelNew()(x0, w0).double()
        got = cuda_gemv(x0, w0).double()
        torch.cuda.synchronize()
        ok = bool(task.check(got, expected))
        line = {"shape": [1, n, k], "matches_naive": ok}
        for name, fn in (("cuda", cuda_gemv), ("triton", cand.q4k_gemv)):
            med, p10, p90 = time_rotating(fn, sets, replays=30)
            line[name] = {
                "us": med * 1e6,
                "p10_us": p10 * 1e6,
                "p90_us": p90 * 1e6,
                "tb_s": task.bytes_moved(batch=1, n=n, k=k) / med / 1e12,
            }
        rows.append(line)
        print(
            f"{n}x{k}: matches naive {ok}; cuda {line['cuda']['us']:.2f} us "
            f"({line['cuda']['tb_s']:.2f} TB/s); triton {line['triton']['us']:.2f} us",
            flush=True,
        )
        del sets
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_q4k_cuda.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
