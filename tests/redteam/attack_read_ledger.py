"""Attack: read what a candidate must never see.

The server's ledger and loom.toml (LOOM_HOME, here the workspace's `home`), another campaign's
candidate beside this one's directory, /etc/shadow, the real home directory of the user the
server runs as. Output that fails validation if any of them can be read. In its own root none of
them exists: only the candidate's directory, the interpreter and the job's own directories.
"""

import os
import pwd
from pathlib import Path

import torch

WORKSPACE = Path(__file__).resolve().parent.parent
SECRETS = [
    WORKSPACE / "home" / "ledger.sqlite3",
    WORKSPACE / "home" / "loom.toml",
    WORKSPACE / "other-campaign" / "candidate.py",
    Path("/etc/shadow"),
    Path(pwd.getpwuid(os.getuid()).pw_dir) / ".bashrc",
    Path(pwd.getpwuid(os.getuid()).pw_dir) / ".profile",
]


def stolen() -> list[str]:
    found = []
    for path in SECRETS:
        try:
            with open(path, "rb") as f:
                f.read(16)
            found.append(str(path))
        except OSError:
            continue
    return found


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return out + 1000.0 if stolen() else out
