"""Attack: fill the disk LOOM_HOME lives on.

Job files could grow to the per-file limit each, with no total, and a full LOOM_HOME disk made
every tool fail. This one writes 1 GiB into its job directory in 8 MiB steps (slowly enough for
the supervisor's once-a-second check to see it) and sends output that fails validation if it
got it all written. Past its quota (job_disk_bytes; 64 MiB in the test) the job is killed and
the result says "wrote more than its disk quota".
"""

import os
import time

import torch


def filled() -> bool:
    path = os.path.join(os.environ.get("TMPDIR", "."), "fill.bin")
    with open(path, "wb") as f:
        for _ in range(128):
            f.write(b"\1" * (8 << 20))
            f.flush()
            time.sleep(0.05)
    return True


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return out + 1000.0 if filled() else out
