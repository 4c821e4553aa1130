"""Every Triton kernel the built-in candidates launch compiles for Hopper and CDNA3, without a GPU.

Triton compiles ahead of time for a named target (`triton.compile(..., target=GPUTarget(...))`)
with the ptxas and LLVM it bundles, so a CPU-only machine can prove that a kernel lowers to
sm_90 cubin and gfx942 HSACO at the exact constexprs the task's real shapes ask for, and that
ptxas assigns it registers without spilling. Timing still needs the GPU.

The launches are recorded, not run: each `@triton.jit` object in the kernel module (a task's
library, which its candidate declares and imports, or one of the model program's fused ops) is
swapped for a recorder, the candidate's model runs at every shape in the task's SHAPES
(TRITON_INTERPRET=1 makes its launcher take the Triton path on CPU tensors), and each distinct
(kernel, signature, constexprs, launch options) is then compiled for real.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from triton.backends import backends as triton_backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")

_module_ids = itertools.count()


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"loom_kernel_compile_{next(_module_ids)}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def jit_kernels(module: ModuleType) -> dict[str, JITFunction]:
    return {name: obj for name, obj in vars(module).items() if isinstance(obj, JITFunction)}


# Files that hold Triton kernels: the tasks' kernel modules and the model program's fused ops (not
# the GPU probes under kernels/tools/).
TRITON_FILES = sorted(
    path
    for path in KERNELS.glob("*/*.py")
    if path.parent.name != "tools" and path.name != "task.py" and "@triton.jit" in path.read_text()
)


@dataclass(frozen=True)
class Launch:
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]


class LaunchRecorder:
    """Stands in for `kernel[grid](...)`: notes the argument types, runs nothing."""

    def __init__(self, name: str, kernel: JITFunction, launches: set[Launch]) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {key: kwargs.pop(key) for key in LAUNCH_OPTIONS if key in kwargs}
            bound = dict(zip(self.kernel.arg_names, args, strict=False)) | kwargs
            signature, constexprs = [], []
            for param in self.kernel.params:
                value = bound[param.name] if param.name in bound else param.default
                if param.is_constexpr:
                    signature.append((param.name, "constexpr"))
                    constexprs.append((param.name, value))
                else:
                    signature.append((param.name, mangle_type(value)))
            self.launches.add(
                Launch(
                    self.name, tuple(signature), tuple(constexprs), tuple(sorted(options.items()))
                )
            )

        return launch


def record_launches(path: Path, monkeypatch) -> tuple[ModuleType, set[Launch]]:
    """Every launch a kernel file makes at its task's shapes: a candidate (or a cheat) through its
    own ModelNew, a task's kernel module through the task's candidate. A kernel file outside a
    task (the model program's fused ops) names its own launches in `example_calls()`."""
    task_file = path.parent / "task.py"
    if task_file.exists():
        # As the judge's jobs import it: the task's directory on sys.path, the module under its
        # own name, which the candidate's import then finds.
        monkeypatch.syspath_prepend(str(path.parent))
        for sibling in path.parent.glob("*.py"):
            monkeypatch.delitem(sys.modules, sibling.stem, raising=False)
        module = importlib.import_module(path.stem)
    else:
        module = load(path)
    launches: set[Launch] = set()
    for name, kernel in jit_kernels(module).items():
        monkeypatch.setattr(module, name, LaunchRecorder(name, kernel, launches))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only steers the launcher; nothing is interpreted
    if task_file.exists():
        task = load(task_file)
        candidate = module if hasattr(module, "ModelNew") else load(path.parent / "candidate.py")
        for shape in task.SHAPES:
            model = candidate.ModelNew(*task.get_init_inputs(**shape))
            with torch.no_grad():
                model(*task.get_inputs(**shape))
    else:
        assert hasattr(module, "example_calls"), f"{path} has kernels but no task.py or example_calls()"
        for call in module.example_calls():
            call()
    monkeypatch.undo()
    return module, launches


def ptxas_report(ptx: str, tmp_path: Path) -> tuple[int, int]:
    """(registers per thread, spill bytes) that ptxas reports for sm_90a."""
    # Triton hands sm_90 and newer to the CUDA 13 ptxas it bundles as `ptxas_blackwell`.
    ptxas = triton.knobs.nvidia.ptxas_blackwell.path
    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    log = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "kernel.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return registers, spills


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("path", TRITON_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kernels_compile_at_task_shapes(path, target, monkeypatch, tmp_path):
    backend = {"sm_90": "nvidia", "gfx942": "amd"}[target]
    if backend not in triton_backends:
        pytest.skip(f"this triton build has no {backend} backend")
    module, launches = record_launches(path, monkeypatch)
    assert launches, "the Triton path launched no kernel"
    kernels = jit_kernels(module)
    builds = []
    for launch in sorted(launches, key=repr):
        builds.append((launch, dict(launch.constexprs), dict(launch.options)))
        # Kernels with a PDL switch take it on NVIDIA GPUs only, where a CPU recording never
        # goes: build that variant too (grid-dependency control in place, launched with PDL).
        if target == "sm_90" and "PDL" in dict(launch.constexprs):
            pdl_options = dict(launch.options)
            from triton.backends.nvidia.compiler import CUDAOptions  # sm_90: the backend is here

            if "launch_pdl" in CUDAOptions.__dataclass_fields__:  # older Tritons lack it
                pdl_options["launch_pdl"] = True
            builds.append((launch, dict(launch.constexprs) | {"PDL": True}, pdl_options))
    for launch, constexprs, options in builds:
        source = ASTSource(
            fn=kernels[launch.kernel],
            signature=dict(launch.signature),
            constexprs=constexprs,
        )
        compiled = triton.compile(source, target=TARGETS[target], options=options)
        binary = "cubin" if target == "sm_90" else "hsaco"
        assert compiled.asm.get(binary), f"{launch.kernel}: no {binary}"
        if target == "sm_90":
            registers, spills = ptxas_report(compiled.asm["ptx"], tmp_path)
            print(
                f"{path.parent.name}/{path.name} {launch.kernel} {sorted({t for _, t in launch.signature if t[0] == '*'})} "
                f"{constexprs} "
                f"{options}: {registers} registers, {spills} B spilled"
            )
            if constexprs.get("PDL"):
                assert "griddepcontrol" in compiled.asm["ptx"], f"{launch.kernel}: PDL=True has no griddepcontrol"
            # A spill in a bandwidth-bound kernel turns into extra memory traffic.
            assert spills == 0, f"{launch.kernel} {constexprs} spills {spills} B"
            assert registers <= 255
