"""Static checks: every cheating class is caught, honest Triton / load_inline code passes clean."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from loom_mcp.judge_models import Finding
from loom_mcp.validate.static_checks import (
    CHECKS,
    check_candidate_file,
    check_candidate_source,
    has_errors,
    rules,
)
from loom_mcp.validate.static_checks.analyzer import CALL_HANDLERS

CANDIDATES = Path(__file__).parent / "candidates"
HONEST = sorted(CANDIDATES.glob("honest_*.py"))

HEADER = "import torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl\n"


def run(body: str, **kwargs) -> list[Finding]:
    return check_candidate_source(HEADER + textwrap.dedent(body), "cand.py", **kwargs)


def checks(findings: list[Finding], severity: str | None = None) -> set[str]:
    return {f.check for f in findings if severity is None or f.severity == severity}


def errors(body: str, **kwargs) -> set[str]:
    return checks(run(body, **kwargs), "error")


# ---------------------------------------------------------------- honest candidates


def test_there_are_honest_candidates():
    assert {p.name for p in HONEST} >= {
        "honest_vector_add.py",
        "honest_softmax.py",
        "honest_rmsnorm.py",
        "honest_inline_cuda.py",
    }


@pytest.mark.parametrize("path", HONEST, ids=lambda p: p.stem)
def test_honest_candidates_are_clean(path: Path):
    findings = check_candidate_file(path)
    assert findings == [], [f.model_dump() for f in findings]


# ---------------------------------------------------------------- one cheating file per class

# One file per cheating class: the check it must trip, and its source (written to a file, so
# the findings' locations are checked too).
CHEATS = {
    "cheat_monkeypatch": ("static.monkeypatch", '''\
"""Cheat: patches the CUDA event timer so every measurement reads a tiny time."""

import torch
import torch.nn as nn

_real_elapsed = torch.cuda.Event.elapsed_time


def _fast(self, end_event):
    return _real_elapsed(self, end_event) * 0.01


torch.cuda.Event.elapsed_time = _fast
setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # noqa: B010


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
'''),
    "cheat_threads": ("static.threads", '''\
"""Cheat: returns an empty buffer and fills it from a background thread after the timer stops."""

import threading

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.empty(a.shape[0], b.shape[1], device=a.device)

        def work():
            out.copy_(a @ b)

        threading.Thread(target=work).start()
        return out
'''),
    "cheat_extra_stream": ("static.extra_stream", '''\
"""Cheat: launches the work on a side stream the harness's end event does not wait for."""

import torch
import torch.nn as nn

_side = torch.cuda.Stream()


class ModelNew(nn.Module):
    def forward(self, a, b):
        with torch.cuda.stream(_side):
            return torch.matmul(a, b)
'''),
    "cheat_inline_stream": ("static.extra_stream", '''\
"""Cheat: inline CUDA that creates its own non-blocking stream and a host thread."""

import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <thread>

__global__ void copy_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}

torch::Tensor fast_copy(torch::Tensor x) {
    auto y = torch::empty_like(x);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    int64_t n = x.numel();
    std::thread([=]() {
        copy_kernel<<<(n + 255) / 256, 256, 0, s>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    }).detach();
    return y;
}
"""

ext = load_inline(
    name="fast_copy",
    cpp_sources="torch::Tensor fast_copy(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["fast_copy"],
)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.fast_copy(x)
'''),
    "cheat_tensor_subclass": ("static.tensor_subclass", '''\
"""Cheat: a lazy tensor that defers the matmul until the checker touches it."""

import torch
import torch.nn as nn


class LazyResult(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.empty(a.shape[0], b.shape[1], device=a.device)
        return torch.Tensor._make_subclass(LazyResult, out)
'''),
    "cheat_reference_use": ("static.reference_use", '''\
"""Cheat: inherits the reference and calls its forward."""

import torch.nn as nn  # noqa: F401
from reference import Model


class ModelNew(Model):
    def forward(self, a, b):
        return super().forward(a, b)
'''),
    "cheat_try_fallback": ("static.try_fallback", '''\
"""Cheat: tries a broken kernel, falls back to PyTorch when it fails."""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(out_ptr, in_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * n_cols + cols)
    tl.store(out_ptr + row * n_cols + cols, x)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        try:
            softmax_kernel[(x.shape[0],)](
                out, x, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1])
            )
        except Exception:
            return torch.softmax(x, dim=-1)
        return out
'''),
    "cheat_bare_except": ("static.try_fallback", '''\
"""Cheat: a bare except around the kernel launch hides that it never ran."""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        try:
            scale_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        except:  # noqa: E722
            pass
        return out
'''),
    "cheat_grader_introspection": ("static.grader_introspection", '''\
"""Cheat: walks the caller's frames to find the reference output and returns it."""

import inspect
import sys

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        for frame_info in inspect.stack():
            ref = frame_info.frame.f_locals.get("ref_output")
            if isinstance(ref, torch.Tensor):
                return ref.clone()
        caller = sys._getframe(1)
        return caller.f_globals["expected"]
'''),
    "cheat_io": ("static.io", '''\
"""Cheat: replays results stashed in shared memory by an earlier run."""

import os
import pickle

import torch
import torch.nn as nn

CACHE = "/dev/shm/loom_results.pkl"


class ModelNew(nn.Module):
    def forward(self, x):
        if os.path.exists(CACHE):
            with open(CACHE, "rb") as f:
                return pickle.load(f)
        out = torch.relu(x)
        torch.save(out, CACHE)
        return out
'''),
    "cheat_pointer_cache": ("static.pointer_cache", '''\
"""Cheat: caches outputs by input address, so timed repeats do no work."""

import torch
import torch.nn as nn

_cache = {}


class ModelNew(nn.Module):
    def forward(self, a, b):
        key = (a.data_ptr(), b.data_ptr(), tuple(a.shape))
        if key in _cache:
            return _cache[key]
        out = torch.matmul(a, b)
        _cache[id(a)] = out
        _cache[key] = out
        return out
'''),
    "cheat_ctypes": ("static.ctypes", '''\
"""Cheat: calls the CUDA runtime directly to create a stream the harness cannot see."""

import ctypes

import torch
import torch.nn as nn

_cudart = ctypes.CDLL("libcudart.so")
_stream = ctypes.c_void_p()
_cudart.cudaStreamCreate(ctypes.byref(_stream))


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
'''),
    "cheat_dynamic_code": ("static.dynamic_code", '''\
"""Cheat: hides its patching in an encoded string the static checks cannot read."""

import base64

import torch
import torch.nn as nn

_payload = base64.b64decode(b"dG9yY2guY3VkYS5zeW5jaHJvbml6ZSA9IGxhbWJkYTogTm9uZQ==").decode()
exec(_payload)
_threading = __import__("thread" + "ing")


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
'''),
    "cheat_posix_files": ("static.io", '''\
"""Cheat: rewrites its published outputs through posix, os's own module, by a computed name."""

import posix

import torch
import torch.nn as nn

_opn = getattr(posix, "op" + "en")


class ModelNew(nn.Module):
    def forward(self, a, b):
        posix.write(_opn("outputs/c0/t0.0.bin", posix.O_WRONLY), b"\\0")
        return torch.matmul(a, b)
'''),
    "cheat_fifo_and_modes": ("static.io", '''\
"""Cheat: plants a FIFO under an output's name and locks its directory from the reference."""

import os

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        os.mkfifo("outputs/pipe")
        os.chmod("outputs", 0)
        return torch.matmul(a, b)
'''),
    "cheat_stdout_via_os": ("static.monkeypatch", '''\
"""Cheat: swaps sys.stdout, reached as os.sys, for an object that runs code at the exit's flush."""

import os

import torch
import torch.nn as nn


class _Late:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


os.sys.stdout = _Late()


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
'''),
}
WARN_ONLY = {
    "cheat_precision_downgrade": ("static.precision_downgrade", '''\
"""Cheat: runs an fp32 matmul in half precision and TF32."""

import torch
import torch.nn as nn

torch.backends.cuda.matmul.allow_tf32 = True
torch.set_float32_matmul_precision("medium")


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a.half(), b.to(torch.float16)).float()
'''),
    "cheat_seed": ("static.seed", '''\
"""Cheat: reseeds the RNG to regenerate the harness's inputs and precompute answers."""

import torch
import torch.nn as nn

torch.manual_seed(42)
_expected = torch.rand(4096, 4096) @ torch.rand(4096, 4096)


class ModelNew(nn.Module):
    def forward(self, a, b):
        torch.cuda.manual_seed_all(42)
        return _expected.to(a.device)
'''),
}


def _cheat_file(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheating_candidates_fail(name: str, tmp_path: Path):
    check, source = CHEATS[name]
    path = _cheat_file(tmp_path, name, source)
    findings = check_candidate_file(path)
    assert has_errors(findings)
    assert check in checks(findings, "error")
    for f in findings:
        assert f.check in CHECKS
        if f.check != "static.no_kernel":
            assert f.line is not None and f.where == f"{path}:{f.line}"
        assert f.message.endswith(".")


@pytest.mark.parametrize("name", sorted(WARN_ONLY))
def test_warning_classes_warn_without_failing(name: str, tmp_path: Path):
    check, source = WARN_ONLY[name]
    findings = check_candidate_file(_cheat_file(tmp_path, name, source))
    assert check in checks(findings, "warning")
    assert check not in checks(findings, "error")


def test_findings_point_at_the_right_lines():
    source = CHEATS["cheat_monkeypatch"][1]
    findings = check_candidate_source(source, "cheat_monkeypatch.py")
    lines = {f.line for f in findings if f.check == "static.monkeypatch"}
    text = source.splitlines()
    assert any("elapsed_time = _fast" in text[line - 1] for line in lines)
    assert any("setattr(torch.cuda" in text[line - 1] for line in lines)


# ---------------------------------------------------------------- monkeypatching


@pytest.mark.parametrize(
    "body",
    [
        "import torch as T\nT.cuda.synchronize = lambda: None\n",
        "from torch.cuda import Event\nEvent.elapsed_time = lambda s, e: 0.0\n",
        "E = torch.cuda.Event\nE.record = lambda *a: None\n",
        "import time\ntime.perf_counter = lambda: 0.0\n",
        "from time import perf_counter\nimport timeit\ntimeit.default_timer = perf_counter\n",
        "triton.testing.do_bench = lambda fn, **k: 0.001\n",
        "torch.allclose = lambda *a, **k: True\n",
        "torch.Tensor.__eq__ = lambda a, b: True\n",
        "del torch.cuda.synchronize\n",
        "object.__setattr__(torch.cuda, 'synchronize', print)\n",
        "torch.cuda.__setattr__('synchronize', print)\n",
        "vars(torch.cuda)['synchronize'] = print\n",
        "torch.cuda.__dict__['synchronize'] = print\n",
        "getattr(torch, 'cuda').synchronize = print\n",
        "t = torch\nsetattr(t.cuda, 'synchronize', print)\n",
        "import builtins\nbuiltins.isinstance = lambda *a: True\n",
        "__builtins__['open'] = None\n",
        "lib = torch.library.Library('aten', 'IMPL')\n",
        "@torch.library.impl('aten::mm', 'CUDA')\ndef mm(a, b):\n    return a\n",
        "def f(ev):\n    ev.elapsed_time = lambda end: 0.001\n",
        "import numpy as np\nnp.testing.assert_allclose = print\n",
    ],
)
def test_monkeypatch_variants(body: str):
    assert "static.monkeypatch" in errors(body)


@pytest.mark.parametrize(
    "body",
    [
        "torch.backends.cudnn.benchmark = True\n",
        "torch._inductor.config.max_autotune = True\n",
        "class ModelNew(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.elapsed_time = 0.0\n        self.record = []\n",
        "x = torch.cuda.Event(enable_timing=True)\ny = torch.cuda.Event.elapsed_time\n",
        "import os\nos.environ['TORCH_CUDA_ARCH_LIST'] = '9.0'\n",
    ],
)
def test_honest_assignments_are_not_monkeypatching(body: str):
    assert "static.monkeypatch" not in checks(run(body))


# ---------------------------------------------------------------- threads and processes


@pytest.mark.parametrize(
    "body",
    [
        "from concurrent.futures import ThreadPoolExecutor\n",
        "import multiprocessing as mp\n",
        "import torch.multiprocessing\n",
        "import os\npid = os.fork()\n",
        "from os import system\n",
        "import subprocess\n",
        "import asyncio\n",
        "import _thread\n",
        "import os\nos.execv('/bin/true', ['true'])\n",
    ],
)
def test_threads_and_processes(body: str):
    assert "static.threads" in errors(body)


# ---------------------------------------------------------------- streams


@pytest.mark.parametrize(
    "body",
    [
        "from torch.cuda import Stream\ns = Stream()\n",
        "s = torch.cuda.ExternalStream(0)\n",
        "torch.cuda.set_stream(None)\n",
        "side = torch.cuda.Stream()\nk = None\n"
        "def f(x):\n    return torch.ops.my.kernel(x, stream=side)\n",
        "def f(x, make):\n    return torch.ops.my.kernel(x, stream=make.side_stream())\n",
        "src = '#include <hip/hip_runtime.h>\\nhipStream_t s; hipStreamCreate(&s);'\n",
        "src = '#include <torch/extension.h>\\nauto s = at::cuda::getStreamFromPool();'\n",
    ],
)
def test_extra_streams(body: str):
    assert "static.extra_stream" in errors(body)


@pytest.mark.parametrize(
    "body",
    [
        "def f(x):\n    return torch.ops.my.k(x, stream=torch.cuda.current_stream().cuda_stream)\n",
        "def f(x):\n    return torch.ops.my.k(x, stream=None)\n",
        "def f(x, stream):\n    return torch.ops.my.k(x, stream=stream)\n",
        "s = torch.cuda.current_stream()\ndef f(x):\n    return torch.ops.my.k(x, stream=s)\n",
        "src = '#include <torch/extension.h>\\nauto s = at::cuda::getCurrentCUDAStream();'\n",
    ],
)
def test_current_stream_is_fine(body: str):
    assert "static.extra_stream" not in checks(run(body))


# ---------------------------------------------------------------- tensor subclasses


@pytest.mark.parametrize(
    "body",
    [
        "class P(nn.Parameter):\n    pass\n",
        "def f(x, cls):\n    return x.as_subclass(cls)\n",
        "from torch.utils._python_dispatch import TorchDispatchMode\n",
        "from torch.overrides import TorchFunctionMode\n",
        "def f(t):\n    return getattr(t, '__torch_dispatch__')\n",
        "class L:\n    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
        "        return func(*args)\n",
    ],
)
def test_tensor_subclass_variants(body: str):
    assert "static.tensor_subclass" in errors(body)


# ---------------------------------------------------------------- reference use


@pytest.mark.parametrize(
    "body",
    [
        "class ModelNew(Model):\n    pass\n",
        "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.ref = Model()\n",
        "def forward(self, x):\n    return Model.forward(self, x)\n",
        "import reference\n",
        "from task import Model\n",
        "from .ref import helper\n",
    ],
)
def test_reference_use(body: str):
    assert "static.reference_use" in errors(body)


def test_reference_use_of_named_task_module_and_custom_reference_name():
    body = "import level1_matmul as t\nclass ModelNew(Baseline):\n    pass\n"
    found = run(body, reference_names=("Baseline",), task_modules=("level1_matmul",))
    assert len([f for f in found if f.check == "static.reference_use"]) == 2


def test_a_dead_copy_of_the_reference_class_is_not_use():
    body = (
        "class Model(nn.Module):\n    def __init__(self):\n        super(Model, self).__init__()\n"
        "    def forward(self, a, b):\n        return torch.matmul(a, b)\n"
    )
    assert "static.reference_use" not in checks(run(body))


# ---------------------------------------------------------------- try/except fallbacks


@pytest.mark.parametrize(
    "body",
    [
        "import torch.nn.functional as F\n"
        "def forward(self, x):\n    try:\n        return self.ext.run(x)\n"
        "    except RuntimeError:\n        return F.softmax(x, -1)\n",
        "def forward(self, x):\n    try:\n        return self.ext.run(x)\n"
        "    except Exception:\n        return x.softmax(-1)\n",
        "class ModelNew(nn.Module):\n    def forward(self, x):\n        try:\n"
        "            return self.ext.run(x)\n        except Exception:\n"
        "            return super().forward(x)\n",
        "import contextlib\ndef forward(self, x):\n"
        "    with contextlib.suppress(Exception):\n        self.ext.run(x)\n    return x\n",
        "def launch(x, out):\n    try:\n        kern[(1,)](x, out)\n    except BaseException:\n"
        "        out = None\n    return out\n",
    ],
)
def test_try_fallback_is_an_error(body: str):
    assert "static.try_fallback" in errors(body)


def test_broad_except_outside_the_hot_path_is_only_a_warning():
    body = (
        "def device_name():\n    try:\n        return torch.cuda.get_device_name()\n"
        "    except Exception:\n        return 'unknown'\n"
    )
    found = run(body)
    assert "static.try_fallback" in checks(found, "warning")
    assert not has_errors(found)


@pytest.mark.parametrize(
    "body",
    [
        "try:\n    import triton.language.extra.cuda as ex\nexcept ImportError:\n    ex = None\n",
        "def forward(self, x):\n    try:\n        return self.ext.run(x)\n"
        "    except RuntimeError as e:\n        torch.cuda.synchronize()\n"
        "        raise RuntimeError('kernel failed') from e\n",
        "def forward(self, x):\n    try:\n        return self.ext.run(x)\n    finally:\n"
        "        pass\n",
    ],
)
def test_honest_try_blocks(body: str):
    assert "static.try_fallback" not in checks(run(body))


# ---------------------------------------------------------------- grader introspection


@pytest.mark.parametrize(
    "body",
    [
        "import gc\nobjs = gc.get_objects()\n",
        "g = globals()\n",
        "import inspect\nf = inspect.currentframe().f_back\n",
        "import __main__\n",
        "import sys\nm = sys.modules['__main__']\n",
        "subs = torch.Tensor.__subclasses__()\n",
        "def f(fn):\n    return fn.__globals__\n",
        "import traceback\ns = traceback.extract_stack()\n",
    ],
)
def test_grader_introspection(body: str):
    assert "static.grader_introspection" in errors(body)


# ---------------------------------------------------------------- I/O


@pytest.mark.parametrize(
    "body",
    [
        "import socket\n",
        "import urllib.request\n",
        "import numpy as np\nnp.save('out.npy', np.zeros(3))\n",
        "from pathlib import Path\nPath('cache.bin').write_bytes(b'')\n",
        "import pathlib\ndata = pathlib.Path('x').read_text()\n",
        "maps = '/proc/self/maps'\n",
        "import marshal\n",
        "def f(x):\n    x.numpy().tofile('dump')\n",
        'src = \'#include <torch/extension.h>\\nFILE* f = fopen("/dev/shm/r", "rb");\'\n',
    ],
)
def test_io(body: str):
    assert "static.io" in errors(body)


@pytest.mark.parametrize(
    "body",
    [
        "import os\nos.makedirs('build', exist_ok=True)\n",
        "import tempfile\nd = tempfile.mkdtemp()\n",
    ],
)
def test_build_directories_are_only_warnings(body: str):
    found = run(body)
    assert "static.io" in checks(found, "warning")
    assert not has_errors(found)


# ---------------------------------------------------------------- pointer caches


@pytest.mark.parametrize(
    "body",
    [
        "c = {}\ndef f(x):\n    return {id(x): x}\n",
        "c = {}\ndef f(x):\n    return c.get(x.data_ptr())\n",
        "seen = set()\ndef f(x):\n    return x.cpu().numpy().tobytes() in seen\n",
        "import functools\nclass ModelNew(nn.Module):\n    @functools.lru_cache(maxsize=None)\n"
        "    def forward(self, x):\n        return x\n",
        "c = {}\ndef f(x):\n    k = (x.data_ptr(), x.shape)\n    c[k] = x\n",
        "src = '#include <torch/extension.h>\\n"
        "static std::unordered_map<const void*, torch::Tensor> cache;'\n",
    ],
)
def test_pointer_caches(body: str):
    assert "static.pointer_cache" in errors(body)


@pytest.mark.parametrize(
    "body",
    [
        "def f(x, k):\n    return k(x.data_ptr(), x.numel())\n",
        "configs = {}\ndef f(m, n):\n    return configs.get((m, n))\n",
        "def f(x, y):\n    return x.data_ptr() == y.data_ptr()\n",
        "src = '#include <torch/extension.h>\\nstatic std::unordered_map<int, int> handles;'\n",
    ],
)
def test_honest_pointer_use(body: str):
    assert "static.pointer_cache" not in checks(run(body))


# ---------------------------------------------------------------- precision, seeds


@pytest.mark.parametrize(
    "body",
    [
        "def f(x):\n    return x.bfloat16()\n",
        "def f(x):\n    with torch.autocast('cuda'):\n        return x\n",
        "@triton.jit\ndef k(a, b):\n    c = tl.dot(a, b, allow_tf32=True)\n",
        "@triton.jit\ndef k(a, b):\n    c = tl.dot(a, b, input_precision='tf32')\n",
        "@triton.jit\ndef k(a):\n    b = a.to(tl.float16)\n",
        "torch.backends.cudnn.allow_tf32 = True\n",
    ],
)
def test_precision_downgrade_warns(body: str):
    found = run(body)
    assert "static.precision_downgrade" in checks(found, "warning")
    assert not has_errors(found)


@pytest.mark.parametrize(
    "body",
    [
        "torch.set_float32_matmul_precision('highest')\n",
        "torch.backends.cuda.matmul.allow_tf32 = False\n",
        "@triton.jit\ndef k(a, b):\n    c = tl.dot(a, b, input_precision='ieee')\n",
    ],
)
def test_full_precision_settings_do_not_warn(body: str):
    assert "static.precision_downgrade" not in checks(run(body))


@pytest.mark.parametrize(
    "body",
    [
        "import random\nrandom.seed(0)\n",
        "import numpy as np\nnp.random.seed(0)\n",
        "g = torch.Generator()\ng.manual_seed(1234)\n",
    ],
)
def test_seeds_warn(body: str):
    found = run(body)
    assert "static.seed" in checks(found, "warning")
    assert not has_errors(found)


# ---------------------------------------------------------------- ctypes, dynamic code


@pytest.mark.parametrize(
    "body",
    [
        "from ctypes import CDLL\n",
        "import cffi\n",
        "src = '#include <dlfcn.h>\\nvoid* h = dlopen(\"libcudart.so\", 1);'\n",
    ],
)
def test_ctypes(body: str):
    assert "static.ctypes" in errors(body)


@pytest.mark.parametrize(
    "body",
    [
        "x = eval('1 + 1')\n",
        "c = compile('x = 1', 'f', 'exec')\n",
        "import importlib\nm = importlib.import_module('threading')\n",
        "import runpy\n",
    ],
)
def test_dynamic_code(body: str):
    assert "static.dynamic_code" in errors(body)


def test_torch_compile_is_not_dynamic_code():
    assert "static.dynamic_code" not in checks(
        run("from torch import compile\nf = compile(print)\n")
    )
    assert "static.dynamic_code" not in checks(run("f = torch.compile(print)\n"))


def test_computed_getattr_on_a_guarded_module_warns():
    found = run("def f(name):\n    return getattr(torch, name)\n")
    assert "static.dynamic_code" in checks(found, "warning")


# ---------------------------------------------------------------- misc


def test_syntax_error_is_a_single_finding_with_its_line():
    found = check_candidate_source("import torch\ndef f(:\n", "bad.py")
    assert len(found) == 1
    assert found[0].check == "static.syntax" and found[0].severity == "error"
    assert found[0].where == "bad.py:2"


def test_pure_pytorch_candidate_gets_a_no_kernel_warning_only():
    src = (
        "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
        "    def forward(self, a, b):\n        return torch.matmul(a, b)\n"
    )
    found = check_candidate_source(src, "plain.py")
    assert [f.check for f in found] == ["static.no_kernel"]
    assert found[0].severity == "warning"


def test_findings_are_sorted_by_line_and_deduplicated():
    found = run("import time\ntime.time = print\ntime.time = print\nimport threading\n")
    lines = [f.line or 0 for f in found]
    assert lines == sorted(lines)
    assert len({(f.check, f.line, f.message) for f in found}) == len(found)


def test_nothing_is_imported_or_executed(tmp_path):
    marker = tmp_path / "ran"
    src = f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(1)\n"
    check_candidate_source(src, "c.py")
    assert not marker.exists()


def test_dtypes_the_task_uses_are_not_downgrades():
    body = "def f(x):\n    return x.bfloat16().to(torch.bfloat16), x.half()\n"
    assert "static.precision_downgrade" in checks(run(body))
    found = run(body, allowed_dtypes=("bf16",))
    lines = [f.message for f in found if f.check == "static.precision_downgrade"]
    assert len(lines) == 1 and ".half()" in lines[0]
    assert "static.precision_downgrade" not in checks(run(body, allowed_dtypes=("bf16", "fp16")))


def test_stream_attributes_are_tracked_by_what_they_hold():
    honest = (
        "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.stream = torch.cuda.current_stream()\n"
        "    def forward(self, x):\n        return torch.ops.my.k(x, stream=self.stream)\n"
    )
    assert "static.extra_stream" not in checks(run(honest))
    cheat = honest.replace("torch.cuda.current_stream()", "torch.cuda.Stream()")
    stream_lines = {f.line for f in run(cheat) if f.check == "static.extra_stream"}
    assert len(stream_lines) == 2  # the creation and the launch that uses it


def test_repeated_warnings_are_reported_once():
    body = "@triton.jit\ndef k(a):\n    b = a.to(tl.float16)\n    c = b.to(tl.float16)\n"
    found = [f for f in run(body) if f.check == "static.precision_downgrade"]
    assert len(found) == 1 and found[0].line == 7


@pytest.mark.parametrize(
    "body",
    [
        "import signal\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x * 2\n",
        "import atexit\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x * 2\n",
        "import weakref\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
        "        y = x * 2\n        weakref.finalize(y, torch.cuda._sleep, 10**9)\n        return y\n",
        "class Later:\n    def __del__(self):\n        torch.cuda._sleep(10**9)\n"
        "class ModelNew(nn.Module):\n    def forward(self, x):\n        Later()\n        return x * 2\n",
    ],
    ids=["signal", "atexit", "weakref.finalize", "__del__"],
)
def test_work_deferred_past_the_call_is_refused(body: str):
    """Timer signals, exit hooks and finalizers run code at a later moment the candidate can
    aim, e.g. while the other arm is timed."""
    assert "static.threads" in errors(body)


def test_a_coding_cookie_cannot_hide_code_in_a_comment():
    # unicode_escape turns the comment's \u000a into a newline: Python imports threading.
    hidden = "# coding: unicode_escape\nimport torch\nx = 1  # \\u000aimport threading\n"
    findings = check_candidate_source(hidden)
    assert [(f.check, f.severity, f.line) for f in findings] == [("static.dynamic_code", "error", 1)]
    assert "unicode_escape" in findings[0].message
    plain = check_candidate_source("# -*- coding: utf-8 -*-\nimport torch\n")
    assert all(f.check != "static.dynamic_code" for f in plain)


# ---------------------------------------------------------------- the rule table
# The static checks' rule table agrees with the published CHECKS, and every family is wired.

RULES = {name: value for name, value in vars(rules).items() if isinstance(value, rules.Rule)}
RULES.update({f"NATIVE_PATTERNS[{i}]": rule for i, (_, rule) in enumerate(rules.NATIVE_PATTERNS)})


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_is_a_published_check_at_a_published_severity(name: str):
    rule = RULES[name]
    assert rule.check in CHECKS, name
    assert rule.severity in CHECKS[rule.check].split("/"), name


def test_every_published_check_and_severity_has_a_rule():
    made = {(r.check, r.severity) for r in RULES.values()}
    for check, severities in CHECKS.items():
        for severity in severities.split("/"):
            assert (check, severity) in made, (check, severity)


def test_each_import_family_names_its_own_modules():
    for modules, rule in rules.MODULE_RULES:
        assert modules and "{name}" in rule.message, rule


def test_a_call_reaches_every_family():
    assert len(CALL_HANDLERS) == len({h.__module__ for h in CALL_HANDLERS})
    source = (
        "import os, torch\n"
        "setattr(torch, 'x', 1)\n"  # patching
        "os.system('x')\n"  # timing (processes)
        "vars()\n"  # reference (grader introspection)
        "open('f')\n"  # escape (files)
        "d.get(x.data_ptr())\n"  # shortcuts (pointer cache)
        "torch.manual_seed(0)\n"  # precision (seeds)
    )
    found = {f.check for f in check_candidate_source(source)}
    assert found >= {
        "static.monkeypatch",
        "static.threads",
        "static.grader_introspection",
        "static.io",
        "static.pointer_cache",
        "static.seed",
    }


def test_a_syntax_error_is_located():
    (finding,) = check_candidate_source("x = (\n", "cand.py")
    assert (finding.check, finding.severity) == ("static.syntax", "error")
    assert finding.where == f"cand.py:{finding.line}" and finding.message.startswith(
        "The source does not parse: "
    )
