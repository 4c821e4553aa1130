"""Exploit class: searching the heap. gc.get_referrers(torch.equal) returns every dict that holds
it, the harness modules' globals among them, where the comparison could be replaced. The module
and names are built from strings; the worker's audit hook refuses the call and records it,
although this file swallows the refusal."""

import sys

import torch

COLLECTOR = getattr(sys, "mod" + "ules")["g" + "c"]


def _referrers(obj) -> list:
    try:
        return getattr(COLLECTOR, "get_" + "referrers")(obj)
    except RuntimeError:
        return []


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.holders = 0

    def forward(self, x):
        self.holders = len(_referrers(torch.equal))
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
