"""kernels/tools/sass_q4k_gemv.py: the CUDA GEMV's consumer loop found and counted in SASS, on a listing
recorded from nvcc 13.0's sm_90 build of the batch-1 kernel and, where nvcc and cuobjdump are
installed, on a fresh build of the candidate."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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


def test_cuda_source_is_read_without_importing_the_candidate(sass_tool):
    source = sass_tool.cuda_source(REPO / "kernels" / "q4k_gemv" / "candidate.py")
    assert "q4k_gemv_b1_kernel" in source and "q4k_gemv_bn_kernel" in source


@pytest.mark.skipif(
    shutil.which("nvcc") is None, reason="needs nvcc (and cuobjdump: $CUOBJDUMP, PATH or beside nvcc)"
)
def test_fresh_build_of_the_candidate(sass_tool):
    if sass_tool.find_cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    for kernel, mmas in (("b1", 8), ("b1_partial", 8), ("bn", 16)):
        sass, registers = sass_tool.build_and_disassemble(REPO / "kernels" / "q4k_gemv" / "candidate.py", kernel)
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
