"""Candidates judged per hour against the size of the device pool (issue 26).

    python benchmarks/pool_throughput.py [--sizes 1,2,4] [--candidates 8] [--work-s 2.0] [--json OUT]

Each synthetic candidate is one job as the judge runs it: the pool's turn and lease through
`dispatch.Leased` (the same path run_validation takes), and inside it one sandboxed worker
process whose work is a fixed sleep. The work is a sleep so that this 2-core machine measures
the scheduling (queue, leases, sandbox start), not compute. The pool is `[executor] cpu_slots`
CPU slots; each size gets its own LOOM_HOME. Linear scaling is `size` x the throughput of a
pool of one; the script prints the fraction of it each size reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import anyio

from loom_mcp.config import load_config
from loom_mcp.devices import probe_devices
from loom_mcp.devices.toolchain import probe_toolchain
from loom_mcp.dispatch import Leased, local_pool, pick_target
from loom_mcp.runtime import open_services
from loom_mcp.sandbox import JobSpec, run_job


async def judge_all(size: int, candidates: int, work_s: float, root: Path) -> dict:
    home = root / f"home-{size}"
    home.mkdir(parents=True)
    (home / "loom.toml").write_text(f'allowed_roots = ["{root}"]\n[executor]\ncpu_slots = {size}\n')
    config = load_config(home)
    open_services(config)  # LOOM_HOME's layout and the sandbox policy, as a server sets them up
    # The pool as a machine without a GPU makes it (cpu_slots), on a GPU host too: the sizes
    # measured must not depend on how many GPUs the host has.
    devices, _ = await anyio.to_thread.run_sync(probe_devices)
    toolchain = await probe_toolchain(config.cache_dir / "toolchain.json")
    local_pool(config, devices, toolchain.model_copy(update={"torch_devices": ["cpu"]}))
    default = await pick_target(config)
    waits: list[float] = []
    devices: dict[str, int] = {}

    async def one(i: int) -> None:
        async with Leased(config, default, None) as held:
            assert held.target.placement is not None
            waits.append(held.target.placement.queued_s)
            devices[held.target.placement.device] = devices.get(held.target.placement.device, 0) + 1
            result = await run_job(
                JobSpec(
                    argv=[sys.executable, "-c", f"import time; time.sleep({work_s})"],
                    job_dir=config.jobs_dir / f"synthetic-{size}-{i}",
                    timeout_s=work_s + 60,
                )
            )
            if result.returncode != 0:
                raise RuntimeError(f"synthetic job {i} failed: {result.stderr_tail[-500:]}")

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(candidates):
            tg.start_soon(one, i)
    wall = time.monotonic() - started
    return {
        "pool": size,
        "candidates": candidates,
        "wall_s": round(wall, 3),
        "per_hour": round(candidates * 3600 / wall, 1),
        "jobs_per_device": devices,
        "max_queue_wait_s": round(max(waits), 3),
    }


async def main(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="loom-pool-") as tmp:
        root = Path(tmp).resolve()
        os.environ["LOOM_ALLOWED_ROOTS"] = str(root)
        for size in sizes:
            rows.append(await judge_all(size, args.candidates, args.work_s, root))
            print(json.dumps(rows[-1]), file=sys.stderr)
    base = next((r["per_hour"] for r in rows if r["pool"] == 1), None)
    ideal_wall = {r["pool"]: args.candidates * args.work_s / r["pool"] for r in rows}
    print(f"{'pool':>4} {'wall s':>8} {'ideal s':>8} {'cand/h':>8} {'of linear':>9}")
    for r in rows:
        r["of_linear"] = round(r["per_hour"] / (base * r["pool"]), 3) if base else None
        r["of_ideal"] = round(ideal_wall[r["pool"]] / r["wall_s"], 3)
        print(
            f"{r['pool']:>4} {r['wall_s']:>8.2f} {ideal_wall[r['pool']]:>8.2f} {r['per_hour']:>8.0f} "
            f"{r['of_linear'] if r['of_linear'] is not None else '-':>9}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"work_s": args.work_s, "rows": rows}, indent=2) + "\n")
    worst = min((r["of_linear"] for r in rows if r["of_linear"] is not None), default=None)
    if worst is not None:
        verdict = "meets" if worst >= 0.9 else "misses"
        print(f"worst scaling {worst:.3f}x of linear: {verdict} the 0.9x target")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,4", help="pool sizes (cpu_slots), comma-separated")
    parser.add_argument("--candidates", type=int, default=8, help="synthetic candidates per pool size")
    parser.add_argument("--work-s", type=float, default=2.0, help="each candidate's work: a sleep of this long")
    parser.add_argument("--json", help="write the rows here too")
    sys.exit(anyio.run(main, parser.parse_args()))
