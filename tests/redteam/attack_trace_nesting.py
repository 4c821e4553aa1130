"""Attack (analyze_trace): 2 MB of opening brackets, `[[[[...`.

A bare JSON array whose first element never ends. ijson builds a prefix string per level
("item.item.item..."), so memory grows with the square of the depth: this 2 MB file grew the
server to 20 GB before it was killed. Generated at test time (the file would be 2 MB):

    python tests/redteam/attack_trace_nesting.py OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

SIZE = 2_000_000


def write(path: Path, size: int = SIZE) -> Path:
    path.write_bytes(b"[" * size)
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "attack_trace_nesting.json")))
