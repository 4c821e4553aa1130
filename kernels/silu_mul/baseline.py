"""The slow baseline for the SiLU-and-multiply task: eager PyTorch, as the reference writes it.

Two kernels (silu, then the multiply) with the silu result stored to memory and read back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        intermediate = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]


if __name__ == "__main__":
    gate_up = torch.randn(8, 2 * 1000, dtype=torch.float64)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(ModelNew()(gate_up), expected)
    print("silu_mul baseline: ok")
