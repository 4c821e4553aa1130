"""The benchmark's numbers come from the trusted timer process, not from the arms that run the
code under test: a candidate that rewrites the clocks around it gains nothing. Through the real
MCP protocol, real sandboxed workers, on CPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mcp import Client

from loom_mcp.bench.stats import analyze_shapes
from loom_mcp.bench.trusted import (
    CONTEXT_SWITCH_SPREAD_S,
    HARNESS_RESIDUAL_MAX_S,
    OWN_TIMING_ALLOWANCE,
    candidate_bracket_cost,
    flag_disagreement,
    harness_residual,
    subtract_overhead,
    trusted_geomean_of,
    trusted_pairs,
)
from loom_mcp.config import load_config
from loom_mcp.judge_models import RatioCI, ShapeSamples
from loom_mcp.server import build_server
from loom_mcp.worker import exchange

REDTEAM = Path(__file__).parent / "redteam"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("timer")
    shutil.copytree(REDTEAM, root / "redteam")
    # Four blocks of fresh arm processes, no more: the forged clock's estimate must stay near
    # 1x on a loaded 2-core machine, where two blocks' geomean strayed past 1.25x.
    (root / "home").mkdir()
    (root / "home" / "loom.toml").write_text("[gate]\nwall_clock_blocks = 4\nwall_clock_max_blocks = 4\n")
    return root


async def bench(workspace: Path, candidate: str) -> dict:
    server = build_server(load_config(workspace / "home",
                                      environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))
    async with Client(server) as client:
        result = await client.call_tool("benchmark", {
            "task": str(workspace / "redteam" / "task_rmsnorm.py"),
            "candidate": str(workspace / "redteam" / candidate), "shapes": ["rows8_d64"]})
    assert result.is_error is False, result.content
    return result.structured_content


def errors(timed: dict) -> set[str]:
    return {f["check"] for f in timed["findings"] if f["severity"] == "error"}


@pytest.mark.anyio
@pytest.mark.slow
async def test_forged_clock_gains_nothing(workspace):
    timed = await bench(workspace, "attack_forged_clock.py")
    shape = timed["shapes"][0]
    # The same maths as the reference: a rewritten clock made it 1.41x when the arm timed itself.
    assert 0.5 < shape["speedup"] < 1.25, shape
    assert shape["candidate_median_s"] > 1e-6
    assert "trusted process" in timed["timer_note"]


@pytest.mark.anyio
@pytest.mark.slow
async def test_partial_work_while_timed_is_caught(workspace):
    assert "benchmark.output_mismatch" in errors(await bench(workspace, "cheat_timed_partial.py"))


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_candidate_busy_while_the_baseline_runs_is_caught(workspace):
    assert "benchmark.busy_while_idle" in errors(await bench(workspace, "cheat_busy_idle.py"))


@pytest.mark.anyio
@pytest.mark.parametrize("tool,arguments", [
    ("run_validation", {"task": "{root}/redteam/task_rmsnorm.py",
                        "candidate": "{root}/redteam/honest_torch.py\0"}),
    ("benchmark", {"task": "{root}/redteam/task_rmsnorm.py\0",
                   "candidate": "{root}/redteam/honest_torch.py"}),
    ("analyze_trace", {"trace": "{root}/x.json\0"}),
    ("start_campaign", {"repo": "{root}/{long}", "goal": "x"}),
])
async def test_unusable_paths_are_bad_input_not_internal(workspace, tool, arguments):
    server = build_server(load_config(workspace / "home",
                                      environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))
    filled = {k: v.format(root=workspace, long="x" * 5000).replace("\\0", "\0")
              for k, v in arguments.items()}
    async with Client(server) as client:
        result = await client.call_tool(tool, filled)
    assert result.is_error is True
    assert "[BAD_INPUT]" in result.content[0].text, result.content[0].text


def test_bracket_cost_is_subtracted_and_floored():
    assert subtract_overhead([3e-5, 1e-5], 1e-5) == pytest.approx([2e-5, 1e-8])
    assert subtract_overhead([5e-6], 1e-5) == [pytest.approx(1e-8)]


def ci(estimate: float, low: float, high: float) -> RatioCI:
    return RatioCI(estimate=estimate, ci_low=low, ci_high=high, level=0.95, resamples=1000,
                   method="paired_bootstrap")


def test_own_clocks_claiming_more_than_the_trusted_brackets_are_flagged():
    trusted = ci(1.0, 0.97, 1.03)
    findings: list = []
    flag_disagreement(trusted, ci(1.05, 1.04, 1.06), findings)
    assert findings == []  # within the brackets' CI and the allowance: an honest small gain
    claimed = 1.03 * (1 + OWN_TIMING_ALLOWANCE) * 1.05
    flag_disagreement(trusted, ci(claimed, claimed - 0.01, claimed + 0.01), findings)
    assert [f.check for f in findings] == ["benchmark.timing_disagreement"]
    assert findings[0].severity == "error"


def _trusted_check(baseline_s: float, candidate_s: float, forged: float, excess_s: float) -> list:
    """Both arms' brackets hold 1.2 us of harness work their own events leave out; the
    candidate's hold `excess_s` more (the context switch into its process costs more); its own
    clock reports `forged` of the truth."""
    noise = [1 + 0.002 * ((i * 7) % 5 - 2) for i in range(40)]
    own_a = [baseline_s * n for n in noise]
    true_b = [candidate_s * n for n in reversed(noise)]
    bracket_a = [t + 1.2e-6 for t in own_a]
    bracket_b = [t + 1.2e-6 + excess_s for t in true_b]
    residual = harness_residual(bracket_a, own_a)
    assert residual == pytest.approx(1.2e-6)
    samples = {
        "s": {
            "a": own_a,
            "b": [t * forged for t in true_b],
            "trusted_a": subtract_overhead(bracket_a, residual),
            "trusted_b": subtract_overhead(bracket_b, residual),
        }
    }
    meta = [{"name": "s"}]
    gate = load_config(None, environ={}).gate
    trusted = trusted_geomean_of(meta, samples, gate)
    assert trusted is not None
    own = analyze_shapes([ShapeSamples(name="s", baseline_s=samples["s"]["a"], candidate_s=samples["s"]["b"])],
                         gate).geomean
    assert own is not None
    findings: list = []
    flag_disagreement(trusted, own, findings)
    return findings


@pytest.mark.parametrize(("baseline_s", "candidate_s", "forged", "flagged"), [
    (10.5e-6, 3.7e-6, 1.0, False),  # the H200 case: an honest 3.7 us kernel at 2.85x
    (60e-6, 20e-6, 1.0, False),
    (60e-6, 20e-6, 0.6, True),  # a clock reporting 60 % of the truth
    (300e-6, 100e-6, 0.8, True),
])
def test_brackets_check_own_clocks_within_their_resolution(baseline_s, candidate_s, forged, flagged):
    """Subtracting the baseline's harness residual and allowing the brackets' resolution, an
    honest few-microsecond kernel is not taken for a forged clock (it was, at 2.85x against
    2.39x), while a clock that shrinks a 20 us call by 40 % or a 100 us call by 20 % is."""
    findings = _trusted_check(baseline_s, candidate_s, forged, excess_s=1.5e-6)
    assert bool(findings) is flagged, findings


def test_the_candidates_bracket_cost_is_its_own_within_the_spread_of_processes():
    """A cheaper context switch into the candidate's process is its own to subtract, and so is
    a dearer one as far as processes honestly differ (an honest softmax was rejected when the
    cap was the baseline's own cost); slowing its empty calls gains no more than that spread."""
    assert candidate_bracket_cost(293e-6, [288e-6, 287e-6, 289e-6]) == pytest.approx(288e-6)
    assert candidate_bracket_cost(283e-6, [292e-6, 293e-6, 294e-6]) == pytest.approx(293e-6)
    assert candidate_bracket_cost(293e-6, [900e-6, 950e-6]) == pytest.approx(293e-6 + CONTEXT_SWITCH_SPREAD_S)
    assert candidate_bracket_cost(293e-6, []) == pytest.approx(293e-6)
    assert candidate_bracket_cost(283e-6, [293e-6], spread=0.0) == pytest.approx(283e-6)  # the strict reading


def _softmax_on_the_h200(candidate_switch_s: float, forged: float, empties_s: float | None = None) -> list:
    """The built-in softmax's shapes as an H200 timed them (own-event medians, us), the switch
    into the baseline's process 283 us and into the candidate's `candidate_switch_s`; its empty
    calls read `empties_s` (default: its switch, as an honest arm's do)."""
    medians = {"t1": (43.8, 8.4), "t8": (46.3, 9.3), "t64": (90.4, 52.7), "v32k": (20.7, 8.1),
               "r512": (23.3, 6.4), "r4096": (133.2, 19.6), "r16384": (497.1, 66.3), "tail": (33.8, 8.6)}
    noise = [1 + 0.002 * ((i * 7) % 5 - 2) for i in range(40)]
    samples, meta = {}, []
    base_cost = 283e-6
    empties = [candidate_switch_s if empties_s is None else empties_s] * 4
    strict = candidate_bracket_cost(base_cost, empties, spread=0.0)
    lenient = candidate_bracket_cost(base_cost, empties)
    for name, (base_us, cand_us) in medians.items():
        own_a = [base_us * 1e-6 * n for n in noise]
        true_b = [cand_us * 1e-6 * n for n in reversed(noise)]
        raw_b = [t + candidate_switch_s + 1.2e-6 for t in true_b]
        trusted_a = subtract_overhead([t + base_cost + 1.2e-6 for t in own_a], base_cost)
        residual = harness_residual(trusted_a, own_a)
        samples[name] = {"a": own_a, "b": [t * forged for t in true_b],
                         "trusted_a": subtract_overhead(trusted_a, residual),
                         "trusted_b": subtract_overhead(subtract_overhead(raw_b, strict), residual),
                         "trusted_b_lenient": subtract_overhead(subtract_overhead(raw_b, lenient), residual)}
        meta.append({"name": name})
    gate = load_config(None, environ={}).gate
    trusted = trusted_geomean_of(meta, samples, gate)
    wide = trusted_geomean_of(meta, samples, gate, key="trusted_b_lenient")
    own = analyze_shapes([ShapeSamples(name=m["name"], baseline_s=samples[m["name"]]["a"],
                                       candidate_s=samples[m["name"]]["b"]) for m in meta], gate).geomean
    assert trusted is not None and wide is not None and own is not None
    findings: list = []
    flag_disagreement(trusted, own, findings, wide)
    return findings


def test_a_dearer_switch_into_the_candidates_process_goes_to_review_not_rejection():
    """On the H200 the candidate's process took 10 us more per switch than the baseline's for
    a whole benchmark; capped at the baseline's cost, that rejected the honest softmax (4.2x by
    its events, 3.6x by the brackets). Now it is a review: the same reading comes from a
    candidate that slows only its empty calls. A clock reporting 40 % of the truth is rejected."""
    (finding,) = _softmax_on_the_h200(293e-6, forged=1.0)
    assert finding.check == "benchmark.timing_ambiguous" and finding.severity == "warning"
    assert _softmax_on_the_h200(283e-6, forged=1.0) == []  # equal switches: nothing to say
    assert [f.severity for f in _softmax_on_the_h200(293e-6, forged=0.4)] == ["error"]
    assert [f.severity for f in _softmax_on_the_h200(283e-6 + 40e-6, forged=1.0)] == ["error"]


def test_slowed_empty_calls_never_clear_a_forged_clock():
    """A candidate no faster than the baseline (20 us), whose empty calls sleep 12 us and whose
    clock claims 4x: the lenient reading alone would clear it; it is sent to review at least."""
    gate, switch = load_config(None, environ={}).gate, 283e-6
    true = [20e-6 * (1 + 0.002 * ((i * 7) % 5 - 2)) for i in range(40)]
    empties = [switch + 12e-6] * 4
    raw_b = [t + switch + 1.2e-6 for t in reversed(true)]
    trusted_a = subtract_overhead([t + switch + 1.2e-6 for t in true], switch)
    residual = harness_residual(trusted_a, true)
    samples = {"s": {
        "trusted_a": subtract_overhead(trusted_a, residual),
        "trusted_b": subtract_overhead(subtract_overhead(raw_b, candidate_bracket_cost(switch, empties, 0.0)), residual),
        "trusted_b_lenient": subtract_overhead(subtract_overhead(raw_b, candidate_bracket_cost(switch, empties)), residual),
    }}
    meta = [{"name": "s"}]
    own = analyze_shapes([ShapeSamples(name="s", baseline_s=true, candidate_s=[t / 4 for t in reversed(true)])],
                         gate).geomean
    strict, wide = trusted_geomean_of(meta, samples, gate), trusted_geomean_of(meta, samples, gate, "trusted_b_lenient")
    assert strict is not None and wide is not None and own is not None
    findings: list = []
    flag_disagreement(strict, own, findings, wide)
    assert findings, "a forged 4x clock went through"
    from loom_mcp.gate import benchmark_reasons
    from loom_mcp.judge_models import BenchmarkEvidence

    codes = {code for code, _ in benchmark_reasons(BenchmarkEvidence(
        benchmark_id="b", device="H200", timer="cuda_events", shapes=[], geomean=None, findings=findings),
        gate)}
    assert codes & {"benchmark.misbehaved", "review.timing_ambiguous"}


def test_the_harness_residual_is_capped_and_never_negative():
    assert harness_residual([1e-3] * 5, [0.9e-3] * 5) == HARNESS_RESIDUAL_MAX_S
    assert harness_residual([1e-6] * 5, [2e-6] * 5) == 0.0
    assert harness_residual([], [1e-6]) == 0.0


def test_late_brackets_leave_the_trusted_side_unless_most_are_late() -> None:
    """A late bracket (the GPU idled waiting for the arm's launches) timed launch latency: its
    pair is dropped, so an honest candidate is not flagged for it. An arm that makes most of
    its calls late cannot empty the trusted side that way: then every pair counts."""
    base, cand = [1.0, 1.0, 1.0, 1.0], [1.0, 9.0, 1.0, 1.0]
    assert trusted_pairs(base, cand, [False] * 4, [False, True, False, False]) == [
        (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]
    everything = trusted_pairs(base, cand, [False] * 4, [True, True, True, False])
    assert everything == list(zip(base, cand))


@pytest.mark.anyio
@pytest.mark.parametrize("sent", [b"[1]\n", b"not json\n", b'{"bye": true, "violations": 1}\n', b""])
async def test_what_an_arm_sends_is_its_own_failure_never_the_servers(tmp_path, sent):
    """The arms and the proof process run candidate code and may send anything, or die: a reply
    that is not a JSON object, or a connection that ends, is that process's ArmError (a crash
    the candidate is charged for), and a forged quit reply cannot break the benchmark's cleanup."""
    import anyio

    from loom_mcp.bench.arms import ArmConnection, ArmError, farewell
    from loom_mcp.worker.guard import findings

    path = tmp_path / "s.sock"
    async with await anyio.create_unix_listener(path) as listener:
        peer = await anyio.connect_unix(path)
        conn = ArmConnection(await listener.accept(), "proof")
        await peer.send(sent) if sent else await peer.aclose()
        if sent.startswith(b'{"bye"'):
            bye = await farewell(conn)
            assert bye["bye"] is True and findings(bye["violations"]) == []  # 1 is not a list
        else:
            with pytest.raises(ArmError, match="proof"):
                await conn.receive(5)
        await conn.stream.aclose()
        if sent:
            await peer.aclose()


OUTER_TASK = '''
import torch

N = 8256  # an N x N float32 output: 273 MB, far more than 8x the inputs (66 KB)


class Model(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


def get_inputs():
    return [torch.randn(N, 1), torch.randn(1, N)]


def get_init_inputs():
    return []
'''


@pytest.mark.anyio
@pytest.mark.slow
async def test_outputs_as_large_as_the_baselines_are_timed_and_larger_ones_refused(workspace):
    """A GEMM with a small K writes far more than its inputs: the timer sizes output slots for
    what the baseline returns. A candidate asking for more than that is refused."""
    (workspace / "outer").mkdir(exist_ok=True)
    task = workspace / "outer" / "task.py"
    task.write_text(OUTER_TASK)
    honest = workspace / "outer" / "honest.py"
    honest.write_text(OUTER_TASK.replace("class Model", "class ModelNew"))
    greedy = workspace / "outer" / "greedy.py"
    greedy.write_text(OUTER_TASK.replace("class Model", "class ModelNew").replace(
        "return a @ b", "return torch.cat([a @ b, a @ b])"))
    # Its own home: two blocks of fresh arms (the fewest allowed), each writing 273 MB outputs.
    # What is checked is the slots' size, not the CI the other tests here need four blocks for.
    home = workspace / "home-outer"
    home.mkdir(exist_ok=True)
    (home / "loom.toml").write_text("[gate]\nwall_clock_blocks = 2\nwall_clock_max_blocks = 2\n")
    server = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))
    async with Client(server) as client:
        timed = await client.call_tool("benchmark", {"task": str(task), "candidate": str(honest)})
        refused = await client.call_tool("benchmark", {"task": str(task), "candidate": str(greedy)})
    assert timed.is_error is False, timed.content
    assert timed.structured_content["blocks"] == 2
    assert timed.structured_content["shapes"][0]["speedup"] > 0
    assert refused.is_error is True
    text = refused.content[0].text
    assert "candidate" in text and "545292288 bytes: more than the 272646144 allowed" in text, text


# ---- the timer's shared tensors (loom_mcp.worker.exchange)
# The timer's shared tensors on a CPU: files the timer writes and each arm maps, output slots
# the timer reads at positions it keeps to itself. One process plays both sides here; the
# benchmark tests run them as separate sandboxed processes.


def test_inputs_round_trip_and_the_arms_view_follows_the_timers_writes(tmp_path):
    live = [[torch.randn(4, 3), 7], [torch.randn(4, 3).to(torch.bfloat16), 2.5]]
    expected = [[v.clone() if isinstance(v, torch.Tensor) else v for v in row] for row in live]
    described = exchange.share_inputs(live, tmp_path)
    arm_view = exchange.open_inputs(described)
    for row, want in zip(arm_view, expected, strict=True):
        assert torch.equal(row[0], want[0]) and row[1] == want[1]
    live[0][0].mul_(2)  # the timer perturbs its mapping in place
    assert torch.equal(arm_view[0][0], expected[0][0] * 2)


def test_the_arms_view_of_the_inputs_is_read_only(tmp_path):
    described = exchange.share_inputs([[torch.zeros(8)]], tmp_path)
    path = described["files"][0][0]["file"]
    code = ("from loom_mcp.worker import exchange;"
            f"t = exchange.open_inputs({described!r})[0][0]; t.fill_(1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode != 0  # the write faults in the arm
    assert torch.equal(exchange.file_tensor(Path(path), torch.float32, [8], False), torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_slots_read_back_what_the_arm_put_at_the_timers_positions(tmp_path, dtype):
    out = (torch.arange(24).reshape(4, 6) % 5).to(dtype)
    specs = exchange.output_specs([out])
    slots, described = exchange.output_slots(specs, tmp_path, torch.device("cpu"), 1 << 20)
    arm_slots = exchange.open_slots(described)
    exchange.put(arm_slots[0], out)
    positions = torch.tensor([0, 5, 23, 24 + 7])  # wrapped modulo the output's size
    got = exchange.read_at(slots[0], specs[0], positions)
    assert got.tolist() == out.reshape(-1)[positions % 24].double().tolist()


def test_an_arm_cannot_ask_for_unbounded_slots(tmp_path):
    with pytest.raises(ValueError, match="more than"):
        exchange.output_slots([{"nbytes": 2 << 20, "dtype": "float32"}], tmp_path,
                              torch.device("cpu"), 1 << 20)
    with pytest.raises(ValueError, match="unsupported dtype"):
        exchange.dtype_named("object")
