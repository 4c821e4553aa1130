"""Attack: shrink the arm's own CUDA event timings from inside the candidate.

On a GPU the arms time their calls with device events in their own process, and those precise
samples feed the statistics. This candidate does the reference's maths but rebinds
`torch.cuda.Event.elapsed_time` (names built from strings, so no static check sees them) to
report 60 % of the truth: 1.67x for nothing. The arm times with the originals it took before
any candidate code was imported, and the trusted timer brackets the same calls from its own
process besides."""

import torch

_done = [False]


def _shrink_event_clock() -> None:
    if _done[0]:
        return
    _done[0] = True
    events = getattr(torch, "cu" + "da").Event
    honest = getattr(events, "elapsed_" + "time")

    def elapsed(self, end):
        return honest(self, end) * 0.6

    setattr(events, "elapsed_" + "time", elapsed)


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            _shrink_event_clock()
        except Exception:
            pass  # refused by the guard: carry on, so only the timing could tell
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
