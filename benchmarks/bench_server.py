#!/usr/bin/env python3
"""Server footprint over real stdio: cold start to the first tools/list answer, device_info
round-trip latency after warm-up, and the server process's RSS.

    python benchmarks/bench_server.py [--runs 5] [--calls 200] [--json]

Targets (issue 2): cold start <= 1.5 s, device_info p50 <= 20 ms, RSS <= 150 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOM = str(Path(sys.executable).with_name("loom-mcp"))
INIT = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}


def send(proc: subprocess.Popen, msg_id: int | None, method: str, params: dict | None = None) -> None:
    msg: dict = {"jsonrpc": "2.0", "method": method}
    if msg_id is not None:
        msg["id"] = msg_id
    if params is not None:
        msg["params"] = params
    proc.stdin.write((json.dumps(msg) + "\n").encode())
    proc.stdin.flush()


def wait_for(proc: subprocess.Popen, msg_id: int) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("server closed stdout")
        msg = json.loads(line)
        if msg.get("id") == msg_id:
            if "error" in msg:
                raise RuntimeError(msg["error"])
            return msg


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_run(home: Path, calls: int) -> dict:
    env = {**os.environ, "LOOM_HOME": str(home), "LOOM_ALLOWED_ROOTS": str(home)}
    start = time.perf_counter()
    proc = subprocess.Popen([LOOM, "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        send(proc, 1, "initialize", INIT)
        wait_for(proc, 1)
        send(proc, None, "notifications/initialized")
        send(proc, 2, "tools/list")
        wait_for(proc, 2)
        cold = time.perf_counter() - start
        rss_start = rss_mb(proc.pid)
        latencies = []
        for i in range(calls + 3):  # the first calls warm the toolchain cache
            t0 = time.perf_counter()
            send(proc, 10 + i, "tools/call", {"name": "device_info", "arguments": {}})
            wait_for(proc, 10 + i)
            if i >= 3:
                latencies.append(time.perf_counter() - t0)
        return {"cold_start_s": cold, "rss_after_start_mb": rss_start, "rss_after_calls_mb": rss_mb(proc.pid),
                "device_info_ms": [x * 1e3 for x in latencies]}
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        one_run(home, 3)  # fills the toolchain cache, as a long-lived install would have
        runs = [one_run(home, args.calls) for _ in range(args.runs)]
    colds = [r["cold_start_s"] for r in runs]
    lat = sorted(x for r in runs for x in r["device_info_ms"])
    summary = {
        "cold_start_s": {"median": statistics.median(colds), "min": min(colds), "max": max(colds), "n": len(colds)},
        "device_info_ms": {"p50": lat[len(lat) // 2], "p95": lat[int(len(lat) * 0.95)], "n": len(lat)},
        "rss_after_start_mb": max(r["rss_after_start_mb"] for r in runs),
        "rss_after_calls_mb": max(r["rss_after_calls_mb"] for r in runs),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        c, d = summary["cold_start_s"], summary["device_info_ms"]
        print(f"cold start to tools/list: median {c['median']:.3f} s (min {c['min']:.3f}, max {c['max']:.3f}, n={c['n']})  target <= 1.5 s")
        print(f"device_info round trip:   p50 {d['p50']:.2f} ms, p95 {d['p95']:.2f} ms (n={d['n']})  target p50 <= 20 ms")
        print(f"server RSS: {summary['rss_after_start_mb']:.0f} MB after start, {summary['rss_after_calls_mb']:.0f} MB after calls  target <= 150 MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
