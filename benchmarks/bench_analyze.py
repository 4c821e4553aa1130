"""Time analyze_trace_file on a (large) trace and report wall time and peak RSS.

    python benchmarks/bench_analyze.py /tmp/large_trace.json [--out-dir DIR] [--repeat N] [--cached CACHE]

Each run happens in a fresh child process so peak RSS (getrusage, RUSAGE_CHILDREN) belongs to
that run alone. With --cached, a second run through analyze_trace_cached is timed as well.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
mode, trace, out, cache = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
from loom_mcp.traces import analyze_trace_file, analyze_trace_cached
t1 = time.perf_counter()
if mode == "cached":
    s = analyze_trace_cached(trace, cache_root=Path(cache))
else:
    s = analyze_trace_file(trace, out_dir=Path(out) if out != "-" else None)
t2 = time.perf_counter()
print(json.dumps({
    "import_s": round(t1 - t0, 3),
    "analyze_s": round(t2 - t1, 3),
    # analyze_trace_cached analyses in a child process of its own (memory/time bounds)
    "maxrss_mib": round(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024, 1),
    "summary_bytes": len(s.model_dump_json()),
    "gpu_events": s.timeline.gpu_events,
    "busy_pct": s.timeline.busy_pct,
    "top_category": s.categories[0].category if s.categories else None,
}))
"""


def run_once(mode: str, trace: Path, out: str, cache: str) -> dict:
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(trace), out, cache],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(p.stderr)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(wall, 3)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--cached", default=None, help="cache root: also time a cold and a warm cached call"
    )
    a = ap.parse_args(argv)
    size = a.trace.stat().st_size
    results = []
    for _ in range(a.repeat):
        out = a.out_dir or tempfile.mkdtemp(prefix="loom-bench-")
        r = run_once("plain", a.trace, out, "-")
        results.append(r)
        print(json.dumps({"run": "analyze_trace_file", "bytes": size, **r}))
    if a.cached:
        for label in ("cached-cold", "cached-warm"):
            r = run_once("cached", a.trace, "-", a.cached)
            print(json.dumps({"run": label, "bytes": size, **r}))
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"max_child_rss_mib": round(children, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
