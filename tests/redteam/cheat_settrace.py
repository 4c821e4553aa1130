"""Exploit class: a trace function. Installed from forward, it would be called with every
harness frame that runs afterwards, and could rewrite their globals (the harness's clock, its
comparison helpers). The name is built from strings; the worker's audit hook refuses the call
and records it, although this file swallows the refusal."""

import sys

import torch

SEEN: list = []


def _tracer(frame, event, arg):
    SEEN.append(event)
    return None


def _install_tracer() -> None:
    try:
        getattr(sys, "set" + "trace")(_tracer)
    except RuntimeError:
        pass


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        _install_tracer()
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
