"""Task and candidate files are read from their AST: never imported, errors name file:line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import DEFAULT_TOLERANCES, GateConfig, Tolerance
from loom_mcp.validate.taskfile import (
    canonical_dtype,
    check_compatible,
    effective_tolerances,
    parse_candidate_source,
    parse_task_source,
    read_candidate,
    read_task,
)

CANDIDATES = Path(__file__).parent / "candidates"

# KernelBench level 1, problem 1, as it appears upstream.
KERNELBENCH_1 = '''import torch
import torch.nn as nn

class Model(nn.Module):
    """
    Simple model that performs a single square matrix multiplication (C = A * B)
    """
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """
        Performs the matrix multiplication.

        Args:
            A (torch.Tensor): Input matrix A of shape (N, N).
            B (torch.Tensor): Input matrix B of shape (N, N).

        Returns:
            torch.Tensor: Output matrix C of shape (N, N).
        """
        return torch.matmul(A, B)

N = 2048 * 2

def get_inputs():
    A = torch.rand(N, N)
    B = torch.rand(N, N)
    return [A, B]

def get_init_inputs():
    return []  # No special initialization inputs needed
'''

# A loom task using every extension.
RMSNORM_TASK = """
import torch
import torch.nn as nn

HIDDEN = 4096

class Model(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

SHAPES = [
    {"name": "decode", "tokens": 1, "hidden": HIDDEN},
    {"name": "prefill", "tokens": 4 * 1024, "hidden": HIDDEN},
    dict(tokens=1000 + 3, hidden=HIDDEN),
]

TOLERANCE = {"bf16": {"atol": 2e-2, "rtol": 2e-2}, "torch.float32": {"atol": 1e-5, "rtol": 1e-5}}
NONDETERMINISTIC = False

def get_inputs(tokens, hidden):
    return [torch.randn(tokens, hidden, dtype=torch.bfloat16)]

def get_init_inputs(hidden):
    return [hidden]

def flops(tokens, hidden):
    return 4 * tokens * hidden

bytes_moved = lambda tokens, hidden: 2 * 2 * tokens * hidden + 2 * hidden

def check(out, ref):
    return (out - ref).abs().max() < 1e-2
"""


def task_with(body: str) -> str:
    base = (
        "import torch\nimport torch.nn as nn\n\n"
        "class Model(nn.Module):\n    def forward(self, x):\n        return x\n\n"
    )
    return base + textwrap.dedent(body)


def bad(source: str, path: str = "t.py") -> LoomError:
    with pytest.raises(LoomError) as info:
        parse_task_source(source, path)
    assert info.value.code is ErrorCode.BAD_INPUT
    return info.value


# ---------------------------------------------------------------- KernelBench compatibility


def test_kernelbench_level1_problem_parses_unchanged(tmp_path):
    path = tmp_path / "1_Square_matrix_multiplication_.py"
    path.write_text(KERNELBENCH_1)
    spec = read_task(path)
    assert spec.path == str(path)
    assert spec.model_forward.params == ["A", "B"]
    assert spec.model_init.params == []
    assert spec.get_inputs.params == [] and spec.get_init_inputs.params == []
    assert not spec.shapes_declared
    assert spec.shape_names == ["default"] and spec.shapes[0].params == {}
    assert spec.tolerance is None and not spec.has_check
    assert spec.flops is None and spec.bytes_moved is None
    assert spec.model_line == 4


def test_reading_does_not_execute_the_file(tmp_path):
    marker = tmp_path / "ran"
    source = KERNELBENCH_1 + f"\nopen({str(marker)!r}, 'w').write('x')\nraise SystemExit(3)\n"
    parse_task_source(source, "t.py")
    assert not marker.exists()


# ---------------------------------------------------------------- loom extensions


def test_full_loom_task():
    spec = parse_task_source(RMSNORM_TASK, "rmsnorm.py")
    assert spec.shapes_declared
    assert spec.shape_names == ["decode", "prefill", "shape2"]  # same auto-name as the worker
    assert spec.shapes[1].params == {"tokens": 4096, "hidden": 4096}
    assert spec.shapes[2].params == {"tokens": 1003, "hidden": 4096}
    assert "name" not in spec.shapes[0].params
    assert spec.tolerance == {
        "bf16": Tolerance(atol=2e-2, rtol=2e-2),
        "fp32": Tolerance(atol=1e-5, rtol=1e-5),
    }
    assert spec.has_check and spec.flops is not None and spec.bytes_moved is not None
    assert spec.bytes_moved.params == ["tokens", "hidden"]
    assert spec.model_init.params == ["hidden", "eps"] and spec.model_init.required == ["hidden"]
    assert spec.nondeterministic is False


def test_effective_tolerances_overlay_task_on_gate_defaults():
    spec = parse_task_source(RMSNORM_TASK, "rmsnorm.py")
    table = effective_tolerances(spec)
    assert table["bf16"] == Tolerance(atol=2e-2, rtol=2e-2)
    assert table["fp16"] == DEFAULT_TOLERANCES["fp16"]
    assert effective_tolerances()["fp32"] == Tolerance(atol=1e-4, rtol=1e-4)
    custom = GateConfig(tolerances={"fp32": Tolerance(atol=1e-3, rtol=1e-3)})
    assert effective_tolerances(None, custom) == {"fp32": Tolerance(atol=1e-3, rtol=1e-3)}


def test_default_tolerance_table():
    assert DEFAULT_TOLERANCES["fp32"] == Tolerance(atol=1e-4, rtol=1e-4)
    assert DEFAULT_TOLERANCES["bf16"] == Tolerance(atol=1e-2, rtol=1e-2)
    assert DEFAULT_TOLERANCES["fp16"] == Tolerance(atol=1e-2, rtol=1e-2)
    assert DEFAULT_TOLERANCES["int"] == Tolerance(atol=0, rtol=0)
    assert DEFAULT_TOLERANCES["fp8"].rtol > DEFAULT_TOLERANCES["bf16"].rtol


@pytest.mark.parametrize(
    "name,canonical",
    [
        ("torch.float32", "fp32"),
        ("float", "fp32"),
        ("BF16", "bf16"),
        ("half", "fp16"),
        ("float8_e4m3fn", "fp8"),
        ("int32", "int"),
        ("uint8", "int"),
        ("bool", "bool"),
        ("float64", "fp64"),
        ("complex64", None),
        ("tensor", None),
    ],
)
def test_canonical_dtype(name: str, canonical: str | None):
    assert canonical_dtype(name) == canonical


def test_nondeterminism_declaration():
    src = task_with(
        "NONDETERMINISTIC = True\ndef get_inputs():\n    return []\n"
        "def get_init_inputs():\n    return []\n"
    )
    assert parse_task_source(src).nondeterministic is True


# ---------------------------------------------------------------- errors name file:line


def test_missing_model():
    err = bad("def get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n")
    assert str(err).startswith("[BAD_INPUT] t.py: ") and "class Model" in str(err)


def test_model_must_be_a_class():
    err = bad("import torch\nModel = torch.nn.Identity\n")
    assert "t.py:2:" in str(err)


def test_model_needs_forward():
    err = bad(
        "import torch\n\nclass Model(torch.nn.Module):\n    pass\n"
        "def get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    assert "t.py:3:" in str(err) and "forward" in str(err)


@pytest.mark.parametrize("missing", ["get_inputs", "get_init_inputs"])
def test_missing_input_functions(missing: str):
    present = {"get_inputs", "get_init_inputs"} - {missing}
    body = "".join(f"def {name}():\n    return []\n" for name in present)
    err = bad(task_with(body))
    assert missing in str(err)


def test_syntax_error_names_the_line():
    err = bad("import torch\nclass Model(:\n    pass\n")
    assert "t.py:2: syntax error" in str(err)


def test_computed_shapes_are_refused_with_their_line():
    src = task_with(
        "SHAPES = [{'n': n} for n in (1, 2)]\n"
        "def get_inputs(n):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    err = bad(src)
    assert "t.py:8:" in str(err) and "literal list" in str(err)


def test_non_literal_shape_value_points_at_it():
    src = task_with(
        "SHAPES = [\n    {'n': 1},\n    {'n': len('abc')},\n]\n"
        "def get_inputs(n):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    err = bad(src)
    assert "t.py:10:" in str(err) and "SHAPES[1]" in str(err)


def test_duplicate_shape_names():
    src = task_with(
        "SHAPES = [{'name': 'a', 'n': 1}, {'name': 'a', 'n': 2}]\n"
        "def get_inputs(n):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    assert "repeats the name 'a'" in str(bad(src))


def test_shape_key_nobody_accepts():
    src = task_with(
        "SHAPES = [{'name': 'a', 'n': 1, 'typo': 2}]\n"
        "def get_inputs(n):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    err = bad(src)
    assert "typo=2" in str(err) and "t.py:8:" in str(err)


def test_shape_missing_a_required_parameter():
    src = task_with(
        "SHAPES = [{'name': 'a', 'n': 1}]\n"
        "def get_inputs(n, m):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    err = bad(src)
    assert "get_inputs() requires m" in str(err) and "'a'" in str(err)


def test_kwargs_functions_accept_any_shape_key():
    src = task_with(
        "SHAPES = [{'name': 'a', 'anything': 1}]\n"
        "def get_inputs(**shape):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    assert parse_task_source(src).shapes[0].params == {"anything": 1}


def test_without_shapes_get_inputs_must_take_no_required_arguments():
    src = task_with("def get_inputs(n):\n    return []\ndef get_init_inputs():\n    return []\n")
    err = bad(src)
    assert "t.py:8:" in str(err) and "requires n" in str(err)


@pytest.mark.parametrize(
    "tolerance,needle",
    [
        ("TOLERANCE = {'fp33': {'atol': 1, 'rtol': 1}}", "not a dtype"),
        ("TOLERANCE = {'fp32': {'atol': 1e-4}}", "must be {'atol'"),
        ("TOLERANCE = {'fp32': {'atol': -1, 'rtol': 0}}", "number >= 0"),
        ("TOLERANCE = {torch.float32: {'atol': 1, 'rtol': 1}}", "literal dict"),
        ("TOLERANCE = {}", "non-empty"),
    ],
)
def test_bad_tolerance(tolerance: str, needle: str):
    src = task_with(
        tolerance + "\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    err = bad(src)
    assert needle in str(err) and "t.py:8:" in str(err)


def test_huge_exponents_are_refused_not_computed():
    src = task_with(
        "SHAPES = [{'n': 10 ** 100000000}]\ndef get_inputs(n):\n    return []\n"
        "def get_init_inputs():\n    return []\n"
    )
    assert "exponent too large" in str(bad(src))


def test_check_must_take_out_and_ref():
    src = task_with(
        "def check(out):\n    return True\ndef get_inputs():\n    return []\n"
        "def get_init_inputs():\n    return []\n"
    )
    assert "check(out, ref)" in str(bad(src))


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(LoomError) as info:
        read_task(tmp_path / "nope.py")
    assert info.value.code is ErrorCode.NOT_FOUND


# ---------------------------------------------------------------- candidates


def test_honest_candidates_define_model_new():
    for name in ("honest_vector_add.py", "honest_softmax.py", "honest_rmsnorm.py"):
        spec = read_candidate(CANDIDATES / name)
        assert spec.model_new_line > 0 and spec.forward is not None


def test_candidate_without_model_new():
    with pytest.raises(LoomError) as info:
        parse_candidate_source("import torch\nclass Model(torch.nn.Module):\n    pass\n", "c.py")
    assert info.value.code is ErrorCode.BAD_INPUT
    assert "c.py: " in str(info.value) and "ModelNew" in str(info.value)


def test_compatible_signatures():
    task = parse_task_source(KERNELBENCH_1, "kb.py")
    cand = parse_candidate_source(
        "class ModelNew:\n    def __init__(self):\n        pass\n"
        "    def forward(self, a, b, scale=1.0):\n        return a\n",
        "c.py",
    )
    check_compatible(task, cand)  # names differ, an extra optional parameter is fine


def test_incompatible_forward_names_both_files():
    task = parse_task_source(KERNELBENCH_1, "kb.py")
    cand = parse_candidate_source(
        "class ModelNew:\n    def forward(self, a):\n        return a\n", "c.py"
    )
    with pytest.raises(LoomError) as info:
        check_compatible(task, cand)
    assert "c.py:2:" in str(info.value) and "kb.py:11" in str(info.value)


def test_incompatible_init():
    task = parse_task_source(RMSNORM_TASK, "rms.py")
    cand = parse_candidate_source(
        "class ModelNew:\n    def __init__(self):\n        pass\n"
        "    def forward(self, x):\n        return x\n",
        "c.py",
    )
    with pytest.raises(LoomError, match="__init__"):
        check_compatible(task, cand)


def test_dtypes_the_task_mentions():
    assert parse_task_source(KERNELBENCH_1, "kb.py").dtypes == []
    assert parse_task_source(RMSNORM_TASK, "rms.py").dtypes == ["bf16", "fp32"]
    src = task_with(
        "SHAPES = [{'name': 'a', 'dtype': 'fp16'}, {'name': 'b', 'dtype': 'float8_e4m3fn'}]\n"
        "def get_inputs(dtype):\n    return []\ndef get_init_inputs():\n    return []\n"
    )
    assert parse_task_source(src).dtypes == ["fp16", "fp8"]


def test_baseline_names_a_file_beside_the_task():
    body = "def get_inputs():\n    return []\n\ndef get_init_inputs():\n    return []\n\n"
    spec = parse_task_source(task_with(body + 'BASELINE = "baseline.py"\n'), "t.py")
    assert spec.baseline == "baseline.py"
    assert parse_task_source(task_with(body), "t.py").baseline is None
    for value in ('"../elsewhere.py"', '"sub/b.py"', '"b.txt"', "3"):
        err = bad(task_with(body + f"BASELINE = {value}\n"))
        assert "BASELINE" in err.message
