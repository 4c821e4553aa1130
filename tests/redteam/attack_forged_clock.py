"""Attack: rewrite the benchmark harness's clock from inside the candidate.

The forward raises and catches an exception, takes the traceback's frame, walks f_back through
the callers and rebinds every clock it finds in their module globals to one that barely moves.
Attribute names are built from strings so no static check sees them. When the timing was taken
in the arm's own process this got identical maths accepted at 1.41x; now the number the gate
uses is taken by another process, and the walk itself is refused where the audit hook runs."""

import time

import torch

_FAKE = [0.0]


def _slow_clock() -> float:
    _FAKE[0] += 1e-9
    return _FAKE[0]


def _rebind_callers_clocks() -> int:
    rebound = 0
    try:
        raise RuntimeError("x")
    except RuntimeError as exc:
        frame = getattr(exc.__traceback__, "tb_" + "frame")
    while frame is not None:
        scope = getattr(frame, "f_" + "globals")
        for name in ("_perf_" + "counter", "perf_" + "counter"):
            if name in scope:
                scope[name] = _slow_clock
                rebound += 1
        for value in list(scope.values()):
            if value is time:
                setattr(value, "perf_" + "counter", _slow_clock)
                rebound += 1
        frame = getattr(frame, "f_" + "back")
    return rebound


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            _rebind_callers_clocks()
        except Exception:
            pass  # refused: carry on, so only the timing could tell
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
