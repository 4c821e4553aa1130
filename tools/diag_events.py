#!/usr/bin/env python3
"""Diagnose event timing of one memory-bound kernel under variants of flush / sleep / sync, alone
and with a second idle CUDA process alive (as the benchmark's two arms are)."""

import statistics
import subprocess
import sys
import time

import torch

N = 64 * 1024 * 1024
x, y = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")


def k():
    return x + y


def measure(variant: str, n: int = 50) -> float:
    times = []
    for _ in range(n):
        flush.zero_()
        if variant == "sync":
            torch.cuda.synchronize()
        if variant == "sleep":
            torch.cuda._sleep(20_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        if variant == "noflush_prelaunch":
            pass
        k()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def flush_only(n: int = 20) -> float:
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        flush.zero_()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


for _ in range(5):
    k()
torch.cuda.synchronize()
print("flush alone us", round(flush_only(), 1))
for v in ("sleep", "plain", "sync"):
    print("alone", v, round(measure(v), 1))
other = subprocess.Popen([sys.executable, "-c", "import torch,time; torch.zeros(1,device='cuda'); time.sleep(60)"])
time.sleep(8)
for v in ("sleep", "plain", "sync"):
    print("with idle 2nd context", v, round(measure(v), 1))
other.kill()
