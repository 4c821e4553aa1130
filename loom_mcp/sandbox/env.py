"""The environment a worker sees: an allowlist, then a secret filter over what survived.

Starting from nothing (not from a copy of the server's environment with bad names removed)
means a credential under a name nobody thought of stays out. The secret filter runs after the
allowlist because allowed prefixes can still carry secrets (`TORCH_HUB_TOKEN`, `HF_TOKEN`-like
names under an allowed prefix, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from fnmatch import fnmatchcase

# Exact names copied from the server's environment.
ALLOWED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TZ",
        "USER",
        "LOGNAME",
        "SHELL",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "PYTHONPATH",
        "PYTHONHOME",
        "LD_LIBRARY_PATH",
        "XDG_CACHE_HOME",
        # compilers used by Triton / torch.utils.cpp_extension / hipcc
        "CC",
        "CXX",
        "CUDAHOSTCXX",
        "CPATH",
        "LIBRARY_PATH",
        "C_INCLUDE_PATH",
        "CPLUS_INCLUDE_PATH",
        # thread pools: results depend on them, so the worker must see the same values
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    }
)

# Prefixes copied from the server's environment: locale, GPU runtimes and toolkits, kernel
# compilers and math libraries.
ALLOWED_PREFIXES = (
    "LC_",
    "CUDA",  # CUDA_HOME, CUDA_PATH, CUDA_VISIBLE_DEVICES, CUDA_LAUNCH_BLOCKING, ...
    "CUBLAS",
    "CUDNN_",
    "NVIDIA_",
    "NVCC_",
    "HIP_",
    "HIPCC_",
    "ROCM_",
    "ROCR_",
    "HSA_",
    "HCC_",
    "AMD_",
    "MIOPEN_",
    "ROCBLAS_",
    "HIPBLASLT_",
    "TRITON_",
    "TORCH",  # TORCH_*, TORCHINDUCTOR_*, TORCHDYNAMO_*
    "PYTORCH_",
    "KINETO_",
    "OMP_",
    "KMP_",
    "MKL_",
)

# Dropped even when allowlisted. Matched on the upper-cased name.
SECRET_PATTERNS = (
    "*_TOKEN",
    "*TOKEN*",
    "*_KEY",
    "*_KEY_*",
    "*APIKEY*",
    "*API_KEY*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*_PAT",
    "*AUTH*",
    "*COOKIE*",
    "*PRIVATE*",
    "AWS_*",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "GITHUB_*",
    "GH_*",
    "GITLAB_*",
    "OPENAI_*",
    "ANTHROPIC_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_*",
)

# Always set: unbuffered output reaches the bounded capture before a crash, and no .pyc
# files are scattered next to candidate sources.
FIXED = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)


def is_allowed(name: str) -> bool:
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def worker_env(
    extra: Mapping[str, str] | None = None, parent: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment for a worker process.

    `parent` defaults to the server's environment; only allowlisted, non-secret names are
    copied. `extra` holds values the server sets on purpose; they override copied ones but go
    through the same secret filter, so a caller cannot forward a credential by accident.
    """
    source = os.environ if parent is None else parent
    env = {k: v for k, v in source.items() if is_allowed(k) and not is_secret(k)}
    env.setdefault("PATH", _DEFAULT_PATH)
    env.update(FIXED)
    for key, value in (extra or {}).items():
        if not is_secret(key):
            env[key] = value
    return env
