"""`loom-mcp demo`: a scripted agent drives the whole loop through the real MCP protocol.

It spawns `loom-mcp --stdio` exactly as a client would, creates a fresh git repository with a
built-in task (a slow RMSNorm), and then: device_info -> start_campaign -> profile ->
analyze_trace -> compile_kernel -> run_validation -> benchmark -> submit_candidate (a cheat,
which must be rejected, then the real candidate) -> campaign_report. Progress goes to stdout
(this is not the stdio server); the server's own logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import anyio


def _say(message: str) -> None:
    print(message, flush=True)


def make_target_repo(workdir: Path) -> Path:
    import git

    repo_dir = workdir / "demo-target"
    repo_dir.mkdir(parents=True)
    data = resources.files("loom_mcp") / "demo_data"
    for name in ("task.py", "candidate.py", "cheat.py"):
        (repo_dir / name).write_text((data / name).read_text())
    repo = git.Repo.init(repo_dir, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "loom demo")
        cw.set_value("user", "email", "demo@loom.invalid")
    repo.index.add(["task.py"])
    repo.index.commit("RMSNorm task (the reference to beat)")
    return repo_dir


def write_config(home: Path, workdir: Path, cpu_only: bool) -> None:
    home.mkdir(parents=True, exist_ok=True)
    lines = [f'allowed_roots = ["{workdir}"]', "[gate]", "max_time_s = 3.0", "min_time_s = 0.3"]
    if cpu_only:
        # A human's choice, made here for the demo only: wall-clock CPU timings may be accepted,
        # and the plausibility cap is widened because CPU ratios against a float64 baseline swing
        # with allocator page faults (3x to 13x seen for one shape on one machine).
        # The 1-token shape's call is mostly the round trip into each arm, and the candidate's
        # read 0.77-0.83x of the baseline's on this CPU in some runs: "clearly slower" here
        # means below 0.85x, not 0.98x.
        lines += ["accept_wall_clock = true", "max_plausible_speedup = 100.0", "max_regression = 0.15"]
    (home / "loom.toml").write_text("\n".join(lines) + "\n")


def wall_clock_notice(home: Path) -> str | None:
    """A plain sentence when the demo's own loom.toml lets wall-clock timings be accepted, so
    nobody takes the demo's CPU accept for what the default policy would do."""
    from loom_mcp.config import CONFIG_FILE, load_config

    if not load_config(home, environ={}).gate.accept_wall_clock:
        return None
    return (
        f"NOTE: this demo's own {home / CONFIG_FILE} sets [gate] accept_wall_clock = true, so "
        "CPU wall-clock timings can be accepted here, and a shape counts as clearly slower "
        "below 0.85x. That is a human's choice made for the demo only: under the default "
        "policy a wall-clock result is needs_review, never accept."
    )


def _short(data: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k}={data.get(k)}" for k in keys)


def server_env(home: Path) -> dict[str, str]:
    """The spawned server's environment. The MCP client passes only a minimal one, so the
    import path (a virtualenv's or a PYTHONPATH install) and the GPU selection are carried over."""
    keep = (
        "PATH",
        "PYTHONPATH",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "ROCM_PATH",
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "LOOM_ALLOWED_ROOTS",
        "TMPDIR",
    )
    env = {name: os.environ[name] for name in keep if name in os.environ}
    return env | {"LOOM_HOME": str(home), "PYTHONUNBUFFERED": "1"}


async def drive(workdir: Path, home: Path) -> int:
    from mcp import Client, StdioServerParameters

    from loom_mcp.report.campaign import clip_words

    repo = make_target_repo(workdir)
    notice = wall_clock_notice(home)
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "loom_mcp.cli", "--stdio", "--home", str(home)], env=server_env(home)
    )
    started = time.monotonic()
    sizes: dict[str, int] = {}

    async def call(client, tool: str, args: dict[str, Any], expect_error: bool = False) -> dict:
        async def on_progress(progress, total, message):
            if message:
                _say(f"      … {message}")

        t0 = time.monotonic()
        result = await client.call_tool(tool, args, progress_callback=on_progress)
        text = result.content[0].text if result.content else ""
        sizes[tool] = max(sizes.get(tool, 0), len(text))
        if result.is_error:
            if not expect_error:
                raise RuntimeError(f"{tool} failed: {text}")
            return {"error": text}
        _say(f"    {tool} answered in {time.monotonic() - t0:.1f} s")
        return result.structured_content or {}

    async with Client(params) as client:
        _say("[1/9] device_info")
        info = await call(client, "device_info", {})
        gpus = [d for d in info["devices"] if d["vendor"] != "cpu"]
        cpu_only = not gpus
        for d in info["devices"]:
            _say(f"    {d['vendor']}:{d['index']} {d['name']} ({d.get('arch') or '-'})")
        if cpu_only:
            _say("    no GPU: validation runs on CPU and every timing below is a CPU wall-clock timing")

        _say("[2/9] start_campaign on a fresh git repository")
        campaign = await call(
            client, "start_campaign", {"repo": str(repo), "goal": "faster RMSNorm", "task": "task.py"}
        )
        cid = campaign["campaign_id"]
        _say(f"    campaign {cid}, base {campaign['base_commit'][:12]}")

        task, candidate, cheat = str(repo / "task.py"), str(repo / "candidate.py"), str(repo / "cheat.py")
        _say("[3/9] profile the reference and analyze the trace")
        prof = await call(
            client, "profile", {"task": task, "shape": "batch_t64_h4096", "warmup": 2, "active": 3, "campaign_id": cid}
        )
        for op in prof["top_ops"][:3]:
            _say(f"    {op['name']}: {op['us']:.1f} us ({op['pct']:.0f} %)")
        analysis = await call(client, "analyze_trace", {"trace": prof["trace_id"], "top_k": 5})
        _say(f"    {analysis['next_step']}")

        _say("[4/9] compile_kernel (Triton)")
        compiled = await call(client, "compile_kernel", {"source": candidate, "language": "triton", "task": task})
        _say(
            "    "
            + _short(compiled, ["ok", "target", "cached"])
            + f", kernels={[k['name'] for k in compiled['kernels']]}"
        )

        _say("[5/9] run_validation")
        valid = await call(client, "run_validation", {"task": task, "candidate": candidate, "campaign_id": cid})
        _say("    " + _short(valid, ["passed", "cases_total", "cases_failed", "device"]))

        _say("[6/9] benchmark (interleaved A/B against the task's Model)")
        bench = await call(client, "benchmark", {"task": task, "candidate": candidate, "campaign_id": cid})
        for s in bench["shapes"]:
            _say(
                f"    {s['name']}: {s['baseline_median_s'] * 1e6:.1f} -> {s['candidate_median_s'] * 1e6:.1f} us, "
                f"x{s['speedup']:.2f} [{s['ci_low']:.2f}, {s['ci_high']:.2f}] ({s['pairs']} pairs)"
            )
        _say(
            f"    geomean x{bench['geomean_speedup']:.2f} [{bench['geomean_ci_low']:.2f}, {bench['geomean_ci_high']:.2f}]"
            + (f"  ({bench['timer_note']})" if bench.get("timer_note") else "")
        )

        _say("[7/9] submit_candidate: a cheating candidate")
        bad = await call(client, "submit_candidate", {"campaign_id": cid, "task": task, "candidate": cheat})
        _say(f"    verdict: {bad['verdict']}")
        for reason in bad["reasons"][:3]:
            _say(f"      - {clip_words(reason, 160)}")

        _say("[8/9] submit_candidate: the real candidate")
        good = await call(client, "submit_candidate", {"campaign_id": cid, "task": task, "candidate": candidate})
        _say(
            f"    verdict: {good['verdict']}"
            + (f", commit {good['commit'][:12]} on {good['branch']}" if good.get("commit") else "")
        )
        if notice and good["verdict"] == "accept" and bench.get("timer") == "wall_clock":
            _say(
                "    accepted on CPU wall-clock timing only because this demo's loom.toml allows "
                "it (accept_wall_clock = true); the default policy would say needs_review"
            )
        for reason in good["reasons"][:3]:
            _say(f"      - {clip_words(reason, 160)}")

        _say("[9/9] campaign_report")
        report = await call(client, "campaign_report", {"campaign_id": cid})
        _say(
            f"    accepted {report['accepted']} of {report['attempts']} submissions; "
            f"cumulative x{report['cumulative_speedup'] or 0:.2f}"
        )
        _say(f"    report: {report['files'].get('markdown')}")

    _say(f"\ndone in {time.monotonic() - started:.0f} s; largest tool result {max(sizes.values())} bytes")
    ok = bad["verdict"] != "accept" and good["verdict"] in ("accept", "needs_review")
    _say(
        json.dumps(
            {
                "cheat": bad["verdict"],
                "candidate": good["verdict"],
                "report": report["files"].get("markdown"),
                "wall_clock_accepts_allowed": notice is not None,
                "largest_result_bytes": sizes,
            }
        )
    )
    return 0 if ok else 1


def run_demo(workdir: Path | None = None) -> int:
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="loom-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    home = base / "loom-home"
    try:
        import torch  # noqa: F401  (the workers need it; say so before spawning anything)
    except ImportError:
        _say("the demo needs torch and triton in this Python: pip install 'loom-mcp[triton]'")
        return 2
    cpu_only = not _has_gpu()
    write_config(home, base, cpu_only)
    _say(f"loom-mcp demo in {base}" + (" (CPU only)" if cpu_only else ""))
    notice = wall_clock_notice(home)
    if notice:
        _say(notice)
    code = anyio.run(drive, base, home)
    _say(f"(files kept in {base})")
    return code


def _has_gpu() -> bool:
    from loom_mcp.devices import probe_devices

    devices, _ = probe_devices()
    return any(d.vendor != "cpu" for d in devices)
