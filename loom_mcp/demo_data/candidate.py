"""Demo candidate: one fused pass in float32.

On a GPU a Triton kernel reads each row once and writes it once; on a CPU (no GPU here) the same
single-pass math runs through torch's fused rms_norm, so the demo shows a real CPU win too.
"""

import torch
import triton
import triton.language as tl

EPS = 1e-6


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(out_ptr + row * hidden + cols, x * inv_rms * w, mask=mask)


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=EPS)
        x = x.contiguous()
        out = torch.empty_like(x)
        tokens, hidden = x.shape
        rmsnorm_kernel[(tokens,)](x, self.weight, out, hidden, EPS, BLOCK=triton.next_power_of_2(hidden))
        return out
