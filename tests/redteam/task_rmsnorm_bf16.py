"""Red-team task: bf16 RMSNorm (fp32 accumulation, one rounding), wide rows."""

import torch

SHAPES = [{"name": "t64_h4096", "tokens": 64, "hidden": 4096}, {"name": "t16_h8192", "tokens": 16, "hidden": 8192}]
EPS = 1e-6


class Model(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter((1.0 + 0.1 * torch.randn(hidden)).to(torch.bfloat16))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * self.weight.float()).to(x.dtype)


def get_inputs(tokens: int = 64, hidden: int = 4096):
    return [torch.randn(tokens, hidden).to(torch.bfloat16)]


def get_init_inputs(tokens: int = 64, hidden: int = 4096):
    return [hidden]
