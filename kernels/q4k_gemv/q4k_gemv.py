"""Fused Q4_K GEMV: y = x @ W.T with W dequantized in registers, never in memory.

Decode reads every weight once per token, so the kernel is a race to stream 0.5625 bytes per
weight at HBM speed. `q4k_gemv` takes the fastest kernel that runs here:

- Batch 1 on NVIDIA Hopper (sm_90): the CUDA kernel on the tensor cores' integer MMAs
  (q4k_gemv.cu, built at first use by q4k_gemv_cuda.py; needs nvcc and ninja), about twice the
  Triton kernel's bandwidth on an H200. Where it cannot be built, the Triton kernel runs instead.
- Batches 2-8 from 1024 weight rows, on Hopper: the batched CUDA kernel, which reads the weight
  once for the whole batch and cuts K where x would leave room for one CTA per SM or none
  (`batched_k_parts`); where even that does not fit, batches of 4096 rows or more run the
  batch-1 kernel once per row of x (`cuda_path`).
- Everything else (smaller weights at batch 2-8, AMD GPUs, the CPU interpreter): the Triton
  kernel (q4k_gemv_triton.py).

The choices are q4k_gemv_policy.py's, the figures behind them in docs/kernels/q4k_gemv.md.
LOOM_Q4K_CUDA=0 turns the CUDA kernels off (=1 also tries them past Hopper, where they have not
been checked). On a CPU tensor the Triton kernel runs only under the interpreter
(`TRITON_INTERPRET=1`, set before this file is imported); without it, x is multiplied in fp32 by
W dequantized with torch, so the model works anywhere.

Self-check: `TRITON_INTERPRET=1 python q4k_gemv.py` (Triton kernels), or on a GPU `python q4k_gemv.py`.
"""

from __future__ import annotations

import os

import torch

# The judge imports a candidate's sources as top-level modules (its directory on sys.path); the
# model program imports them as the kernels.q4k_gemv package.
try:
    from q4k_gemv_cuda import CudaGemvB1, cuda_gemv_b1
    from q4k_gemv_policy import BLOCK_BYTES, QK_K, GemvConfig, cuda_path, cuda_takes_batch, pick_config
    from q4k_gemv_triton import triton_gemv
except ModuleNotFoundError:
    from kernels.q4k_gemv.q4k_gemv_cuda import CudaGemvB1, cuda_gemv_b1
    from kernels.q4k_gemv.q4k_gemv_policy import BLOCK_BYTES, QK_K, GemvConfig, cuda_path, cuda_takes_batch, pick_config
    from kernels.q4k_gemv.q4k_gemv_triton import triton_gemv


def _cuda_kernel(
    x: torch.Tensor, weight_q4k: torch.Tensor, n_blocks: int, follows_small_kernel: bool = False
) -> CudaGemvB1 | None:
    """The CUDA kernel, where it is built, its shared memory fits, and x and W are 16-byte
    aligned (its vector loads and bulk copies)."""
    if x.data_ptr() % 16 or weight_q4k.data_ptr() % 16:
        return None
    kernel = cuda_gemv_b1(x.device)
    return kernel if kernel is not None and kernel.fits(n_blocks, follows_small_kernel) else None


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _dequantize_q4_k(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes [..., n * 144] into float32 [..., n * 256] (the CPU path without Triton)."""
    blocks = packed.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    # Chunk c's low nibbles are sub-block 2c, its high nibbles 2c+1. (No tensor literal here:
    # copying one to the GPU inside forward would break CUDA-graph capture.)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    weights = (d * sc.float())[:, :, None] * codes - (dmin * m.float())[:, :, None]
    return weights.reshape(*packed.shape[:-1], -1)


def q4k_gemv(
    x: torch.Tensor,
    weight_q4k: torch.Tensor,
    config: GemvConfig | None = None,
    constant_weight: bool = False,
    follows_small_kernel: bool = False,
) -> torch.Tensor:
    """x [batch, K] @ dequantize(weight_q4k [N, K / 256 * 144]).T -> [batch, N] in x's dtype.

    `constant_weight`: the caller promises no kernel writes the weight (a model's parameters).
    The CUDA kernel is then launched as a programmatic dependent (PDL, Hopper): it streams the
    weight while the kernel before it still runs, and waits for that kernel only before it
    reads x. Without the promise it is a plain launch, since a weight written by the kernel
    just before could be read stale.
    `follows_small_kernel`: what runs just before is a small kernel (a norm, an elementwise
    op, decode attention), not another heavy stream such as this GEMV: at batch 1 the CUDA
    kernel then prefetches deeper from K = 8192 (`cuda_stages` has the measurements). Only
    the ring depth changes, never the result."""
    batch, k = x.shape
    n_rows = weight_q4k.shape[0]
    if k % QK_K or weight_q4k.dtype != torch.uint8 or weight_q4k.shape[1] != k // QK_K * BLOCK_BYTES:
        raise ValueError(f"weight must be uint8 [N, {k // QK_K * BLOCK_BYTES}] Q4_K rows for K={k}")
    # The kernel reads 16-bit activations; float32 ones (the model program's CPU reference
    # runs) take the torch path.
    if not _runs_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
        return (x.float() @ _dequantize_q4_k(weight_q4k).T).to(x.dtype)

    weight_q4k = weight_q4k.contiguous()
    x = x.contiguous()
    out = torch.empty((batch, n_rows), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    n_blocks = k // QK_K
    kernel = (
        _cuda_kernel(x, weight_q4k, n_blocks, follows_small_kernel and batch == 1)
        if config is None and x.is_cuda and cuda_takes_batch(n_rows, batch)
        else None
    )
    if kernel is not None:
        batched_per_sm = kernel.batched_ctas_per_sm(n_blocks, batch, n_rows) if batch > 1 else 0
        if os.environ.get("LOOM_Q4K_BATCHED") == "0":  # for A/B timing against per-row launches
            batched_per_sm = 0
        path = cuda_path(n_rows, batch, batched_per_sm)
        if path == "batched":
            kernel.batched(x, weight_q4k, out, dependent=constant_weight)
            return out
        if path == "rows":
            kernel(x, weight_q4k, out, dependent=constant_weight, follows_small_kernel=follows_small_kernel)
            return out
    triton_gemv(x, weight_q4k, out, config or pick_config(n_rows, n_blocks, batch))
    return out


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    cases = [(1, 32, 256, torch.bfloat16), (3, 20, 512, torch.float16), (1, 9, 1280, torch.bfloat16)]
    for batch, n_rows, k, dtype in cases:
        weight = torch.randint(0, 256, (n_rows, k // QK_K * BLOCK_BYTES), dtype=torch.uint8)
        halves = weight.view(torch.float16)  # d and dmin of every block: finite, Llama-sized
        halves[:, 0::72] = (1e-4 * (0.5 + torch.rand(n_rows, k // QK_K))).half()
        halves[:, 1::72] = (7.5e-4 * (0.5 + torch.rand(n_rows, k // QK_K))).half()
        x = torch.randn(batch, k, dtype=dtype)
        expected = x.double() @ _dequantize_q4_k(weight).double().T
        for config in [None, GemvConfig(2, 4, 1), GemvConfig(4, 8, 2, True), GemvConfig(64, 4, 4, method="mma")]:
            out = q4k_gemv(x.to(device), weight.to(device), config)
            torch.testing.assert_close(out.double().cpu(), expected, atol=1e-2, rtol=1e-2)
    print(f"q4k_gemv ({path} path on {device}): ok")
