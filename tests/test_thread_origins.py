"""Whose code started a thread: installed code the candidate cannot write is the library's,
wherever the distribution put it; anything the candidate could have written is not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import json, sys
    sys.path[1:1] = sys.argv[2:]  # the import roots, as a distribution or PYTHONPATH puts them
    from loom_mcp.worker.harness import code_classifier
    classify = code_classifier(sys.argv[1])
    names = {name: classify(path) for name, path in [
        ("readonly_root", sys.argv[2] + "/tqdm_like.py"),
        ("writable_root", sys.argv[3] + "/planted.py"),
        ("candidate_sibling", sys.argv[4] + "/cand/helper.py"),
        ("candidate", sys.argv[1]),
    ]}
    print(json.dumps(names))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_readonly_import_roots_are_library_code(tmp_path: Path) -> None:
    readonly, writable, tree = tmp_path / "dist", tmp_path / "rw", tmp_path / "tree"
    for d in (readonly, writable, tree / "cand"):
        d.mkdir(parents=True)
    candidate = tree / "cand" / "candidate.py"
    candidate.write_text("x = 1\n")
    # A read-only mount of `readonly` and of `tree` (which holds the candidate: being read-only
    # does not make the candidate's own directory library code).
    script = (f"mount --bind {readonly} {readonly} && mount -o remount,bind,ro {readonly} && "
              f"mount --bind {tree} {tree} && mount -o remount,bind,ro {tree} && "
              f'exec "$0" -c "$1" {candidate} {readonly} {writable} {tree}')
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
                          sys.executable, PROBE], capture_output=True, text=True, timeout=180,
                         cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    if run.returncode != 0 and "unshare" in run.stderr and "Operation not permitted" in run.stderr:
        pytest.skip("this kernel refuses unprivileged mount namespaces")
    assert run.returncode == 0, run.stderr[-2000:]
    kinds = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    assert kinds == {"readonly_root": "library", "writable_root": "unknown",
                     "candidate_sibling": "candidate", "candidate": "candidate"}
