"""How much disk a job's directories hold: what its quota is checked against."""

from __future__ import annotations

import os
from pathlib import Path


def disk_usage(paths: tuple[Path, ...], stop_above: int | None = None) -> int:
    """Bytes allocated to the files under `paths` (nested paths counted once, symlinks not
    followed, hard links once). Stops counting once past `stop_above`. Blocking."""
    roots = sorted({str(p) for p in paths})
    roots = [r for r in roots if not any(r != o and r.startswith(o.rstrip("/") + "/") for o in roots)]
    # A root swapped for a link since the job was planned is not the job's: never scan where it
    # points (the host's whole tree, say).
    roots = [r for r in roots if not os.path.islink(r)]
    total = 0
    seen: set[tuple[int, int]] = set()
    todo = list(roots)
    while todo:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            try:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
                    except OSError:
                        continue
                    if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                        if (st.st_dev, st.st_ino) in seen:
                            continue
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
            except OSError:  # the directory went away or became unreadable while listed
                pass
        if stop_above is not None and total > stop_above:
            break
    return total
