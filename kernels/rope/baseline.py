"""The slow baseline for the RoPE task: the reference's eager PyTorch, as written.

About a dozen kernels: angles, cos, sin, fp32 copies of q and k, rotate_half's slices and
concatenation, the products, the sums and the casts back.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class ModelNew(torch.nn.Module):
    def __init__(self, head_dim: int = 128, rope_theta: float = 500000.0) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (rope_theta**exponents))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles whatever the module's dtype, as Hugging Face forces with autocast off.
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        q32, k32 = q.float(), k.float()
        q_rotated = q32 * cos + rotate_half(q32) * sin
        k_rotated = k32 * cos + rotate_half(k32) * sin
        return q_rotated.to(q.dtype), k_rotated.to(k.dtype)


if __name__ == "__main__":
    positions = torch.tensor([0, 1, 4095])
    q = torch.randn(3, 4, 128, dtype=torch.float64)
    q_rotated, _ = ModelNew()(positions, q.float(), q.float())
    # Rotation preserves each pair's length, and position 0 is the identity.
    pairs = torch.stack(q.chunk(2, dim=-1)).pow(2).sum(0)
    rotated_pairs = torch.stack(q_rotated.double().chunk(2, dim=-1)).pow(2).sum(0)
    torch.testing.assert_close(rotated_pairs, pairs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_rotated[0].double(), q[0], atol=1e-6, rtol=1e-6)
    print("rope baseline: ok")
