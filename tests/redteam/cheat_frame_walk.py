"""Exploit class: reaching the harness through frames. forward raises and catches an exception,
takes the frame from its traceback, walks f_back up to the harness's frames and rebinds the
harness's module-level helpers in their f_globals (the original attack rebound a benchmark
harness's clock). Every attribute name is built from strings, so the static checks see only
computed getattr calls; the worker's audit hook refuses the first frame and records it, even
though this file swallows the refusal and computes honestly afterwards."""

import torch

TRACEBACK = "".join(["__trace", "back__"])
FRAME = "".join(["tb_", "frame"])
BACK = "".join(["f_", "back"])
GLOBALS = "".join(["f_", "glob", "als"])
TARGETS = ("perf_counter", "_timer", "clock", "_torch_equal", "_same_bits")


def _always_equal(*args, **kwargs):
    return True


def _rebind_harness_globals() -> int:
    rebound = 0
    try:
        raise LookupError("probe")
    except LookupError as caught:
        try:
            frame = getattr(getattr(caught, TRACEBACK), FRAME)
        except RuntimeError:  # refused: carry on as if nothing happened
            return 0
    while frame is not None:
        scope = getattr(frame, GLOBALS)
        if scope.get("__name__") != __name__:
            for name in TARGETS:
                if name in scope:
                    scope[name] = _always_equal
                    rebound += 1
        frame = getattr(frame, BACK)
    return rebound


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.rebound = 0

    def forward(self, x):
        self.rebound += _rebind_harness_globals()
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
