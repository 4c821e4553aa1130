"""The Q4_K GEMV's alternative tilings and its TF32 tensor-core variant: correct under Triton's
interpreter (each candidate file's own self-check) and lowered to Hopper wgmma without spills.
Which one is fastest is for `kernels/tools/sweep_q4k.py` on a GPU; these tests keep every variant the
sweep can pick honest here."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


@pytest.mark.parametrize("task", ["q4k_gemv", "q4k_gemm"])
@pytest.mark.slow
def test_candidate_self_check_under_the_interpreter(task):
    """The file's __main__ compares every configuration it lists with a float64 product."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(KERNELS / task / "candidate.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(triton path on cpu): ok" in run.stdout


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")
def test_tensor_core_variant_lowers_to_wgmma_without_spills(tmp_path):
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in backends:
        pytest.skip("this triton build has no nvidia backend")
    spec = importlib.util.spec_from_file_location(
        "q4k_gemv_variants", KERNELS / "q4k_gemv" / "candidate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*i32",
        "out_ptr": "*bf16",
        "batch": "i32",
        "n_rows": "i32",
        "n_blocks": "i32",
        "w_row_words": "i32",
        "x_row_stride": "i32",
        "out_row_stride": "i32",
        "BLOCK_N": "constexpr",
        "BLOCK_KB": "constexpr",
        "BLOCK_B": "constexpr",
    }
    names = list(signature)
    aligned = [
        "x_ptr",
        "w_ptr",
        "out_ptr",
        "n_rows",
        "n_blocks",
        "w_row_words",
        "x_row_stride",
        "out_row_stride",
    ]
    source = ASTSource(
        fn=module.q4k_gemv_mma_kernel,
        signature=signature,
        constexprs={"BLOCK_N": 64, "BLOCK_KB": 4, "BLOCK_B": 16},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".tf32" in ptx  # the tensor cores do the products
    (tmp_path / "k.ptx").write_text(ptx)
    log = subprocess.run(
        [
            triton.knobs.nvidia.ptxas_blackwell.path,
            "-arch=sm_90a",
            "-v",
            str(tmp_path / "k.ptx"),
            "-o",
            str(tmp_path / "k.cubin"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    assert spills == 0, log
