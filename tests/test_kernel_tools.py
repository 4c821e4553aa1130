"""The scripts under kernels/tools/: sass_q4k_gemv.py (the CUDA GEMV's consumer loop in SASS) and
model_ab.py (the model program A/B'd through loom's own benchmark_command)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- sass_q4k_gemv.py
# kernels/tools/sass_q4k_gemv.py: the CUDA GEMV's consumer loop found and counted in SASS, on a
# listing recorded from nvcc 13.0's sm_90 build of the batch-1 kernel and, where nvcc and cuobjdump
# are installed, on a fresh build of the candidate.

LISTING = REPO / "tests" / "fixtures" / "sass" / "q4k_gemv_b1_sm90_loop.sass"


@pytest.fixture(scope="module")
def sass_tool():
    spec = importlib.util.spec_from_file_location("sass_q4k_gemv", REPO / "kernels" / "tools" / "sass_q4k_gemv.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_opcode_drops_predicates_and_modifiers(sass_tool):
    assert sass_tool.opcode("@!P0 LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT") == "LOP3"
    assert sass_tool.opcode("IMMA.16832.U8.S8 R8, R8.ROW, R12.COL, R8") == "IMMA"
    assert sass_tool.opcode("@P2 BRA 0x3db0") == "BRA"


def test_consumer_loop_of_the_recorded_listing(sass_tool):
    loop = sass_tool.consumer_loop(LISTING.read_text())
    summary = sass_tool.summary(loop)
    # the landed kernel: eight MMAs per block in a 171-instruction loop that closes on a branch
    # back to its first instruction; 32 of its LOP3 are the code masks, one per A register
    assert summary["instructions"] == 171 and summary["imma"] == 8
    assert summary["mix"]["LOP3"] >= 32 and summary["mix"]["LDS"] == 11
    assert sass_tool.opcode(loop[-1][1]) == "BRA" and loop[-1][1].endswith(summary["from"])
    # the listing holds instructions before and after the loop, which it leaves out
    assert len(sass_tool.instructions(LISTING.read_text())) > summary["instructions"]


def test_listings_without_the_loop_are_refused(sass_tool):
    with pytest.raises(ValueError, match="no IMMA"):
        sass_tool.consumer_loop("        /*0000*/                   LDC R1, c[0x0][0x28] ;\n")
    no_branch_back = "\n".join(
        f"        /*{address:04x}*/                   {text} ;"
        for address, text in [(0x10, "IMMA.16832.U8.S8 R8, R8.ROW, R12.COL, R8"), (0x20, "BRA 0x40"), (0x40, "EXIT")]
    )
    with pytest.raises(ValueError, match="backward branch"):
        sass_tool.consumer_loop(no_branch_back)


def test_cuda_source_is_read_without_importing_anything(sass_tool, tmp_path):
    source = sass_tool.cuda_source(REPO / "kernels" / "q4k_gemv" / "q4k_gemv.cu")
    assert "q4k_gemv_b1_kernel" in source and "q4k_gemv_bn_kernel" in source
    # an older checkout's single-file candidate kept it in a string
    old = tmp_path / "candidate.py"
    old.write_text(f"import torch\n\nCUDA_SOURCE = {source!r}\n")
    assert sass_tool.cuda_source(old) == source


@pytest.mark.skipif(
    shutil.which("nvcc") is None, reason="needs nvcc (and cuobjdump: $CUOBJDUMP, PATH or beside nvcc)"
)
def test_fresh_build_of_the_candidate(sass_tool):
    if sass_tool.find_cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    for kernel, mmas in (("b1", 8), ("b1_partial", 8), ("bn", 16)):
        sass, registers = sass_tool.build_and_disassemble(REPO / "kernels" / "q4k_gemv" / "q4k_gemv.cu", kernel)
        summary = sass_tool.summary(sass_tool.consumer_loop(sass))
        assert summary["imma"] == mmas, (kernel, summary)
        # two CTAs of 288 threads must fit an SM's 65,536 registers
        assert 0 < registers[sass_tool.KERNELS[kernel]] <= 65536 // (2 * 288)


def test_command_line_on_a_saved_listing(sass_tool, capsys, monkeypatch):
    import json

    monkeypatch.setattr(sys, "argv", ["sass_q4k_gemv.py", "--sass", str(LISTING), "--kernel", "bn"])
    assert sass_tool.main() == 0
    printed = json.loads(capsys.readouterr().out)
    # the listing's own kernel, whatever --kernel says, and no registers (no build ran)
    assert printed["kernel"] == "_Z18q4k_gemv_b1_kernelPKhPKtPtiiii"
    assert printed["instructions"] == 171 and "registers" not in printed


# ---------------------------------------------------------------- model_ab.py
# kernels/tools/model_ab.py: the model program A/B'd through loom's own benchmark_command, over a
# real stdio server, on the CPU (the tiny config): both arms run, every metric is compared, and the
# revisions each arm ran are reported.

TOOL = REPO / "kernels" / "tools" / "model_ab.py"


def load_tool():
    """kernels/tools/ as an import root; the tool puts benchmarks/ on sys.path for kernels_campaign."""
    if str(TOOL.parent) not in sys.path:
        sys.path.insert(0, str(TOOL.parent))
    return importlib.import_module("model_ab")


def namespace(**given) -> argparse.Namespace:
    defaults = {"env": [], "baseline_env": [], "baseline_revision": None, "revision": None, "runs": 5, "warmup": 1}
    return argparse.Namespace(**(defaults | given))


def test_arms_are_built_from_settings_and_revisions():
    tool = load_tool()
    bench = ["--random-config", "tiny"]
    arguments = tool.tool_arguments(namespace(env=["LOOM_Q4K_STAGES=16:3,56:4"]), bench)
    assert arguments["command"][1:3] == ["LOOM_Q4K_STAGES=16:3,56:4", sys.executable]
    assert arguments["baseline_command"] == [sys.executable, "-m", "kernels.llama_q4k.bench", *bench]
    assert "baseline_revision" not in arguments and arguments["cwd"] == str(REPO)
    # the same command at two revisions: no baseline command, the repository named
    arguments = tool.tool_arguments(namespace(baseline_revision="HEAD~1"), bench)
    assert "baseline_command" not in arguments
    assert (arguments["baseline_revision"], arguments["revision"], arguments["repo"]) == ("HEAD~1", "HEAD", str(REPO))
    for wrong in (namespace(), namespace(revision="HEAD"), namespace(env=["STAGES"]), namespace(env=["1X=2"])):
        with pytest.raises(SystemExit):
            tool.tool_arguments(wrong, bench)


@pytest.mark.slow
def test_the_model_program_at_two_revisions_through_a_stdio_server(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    child = subprocess.run(
        [sys.executable, str(TOOL), "--baseline-revision", "HEAD", "--baseline-env", "LOOM_Q4K_PDL=0",
         "--runs", "3", "--warmup", "0", "--out", str(tmp_path), "--home", str(tmp_path / "home"), "--",
         "--random-config", "tiny", "--prompt-len", "16", "--gen", "4", "--runs", "1", "--device", "cpu",
         "--reference", "none"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    recorded = json.loads((tmp_path / "model_ab.json").read_text())
    result = recorded["result"]
    assert recorded["arguments"]["baseline_command"][1] == "LOOM_Q4K_PDL=0"
    assert result["runs_per_arm"] == 3 and not result["failed_runs"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert result["revisions"] == {"baseline": head, "candidate": head}
    names = {m["name"]: m for m in result["metrics"]}
    assert set(names) == {spec.split(":")[0] for spec in load_tool().METRICS}
    decode = names["decode_tokens_per_s"]
    assert decode["higher_is_better"] and decode["baseline"]["median"] > 0 and decode["candidate"]["median"] > 0
    assert decode["ratio"]["ci_low"] <= decode["ratio"]["estimate"] <= decode["ratio"]["ci_high"]
    assert "| decode_tokens_per_s |" in child.stdout
    # the server removed the revision checkouts when it was done
    assert not any((tmp_path / "home" / "worktrees" / "_revisions").glob("*/*"))
