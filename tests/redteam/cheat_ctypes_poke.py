"""Exploit class: poking memory with ctypes. ctypes is taken from torch's namespace (no import
for the static checks to see) and used to read objects' bytes at their addresses, the first
step of overwriting a harness value in place. The worker's audit hook refuses the ctypes calls
and records them, although this file swallows the refusal."""

import torch

NATIVE = getattr(torch, "".join(["cty", "pes"]))


def _peek(obj) -> bytes:
    try:
        return getattr(NATIVE, "string" + "_at")(id(obj), 16)
    except RuntimeError:
        return b""


def _poke_flag(obj) -> None:
    try:
        cell = getattr(NATIVE, "c_" + "ssize_t").from_address(id(obj))
        cell.value += 1  # an extra reference: harmless here, a write anywhere in general
    except RuntimeError:
        pass


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.seen = b""

    def forward(self, x):
        self.seen = _peek(torch.equal)
        _poke_flag(torch.equal)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
