"""The environment a worker sees: an allowlist, then a secret filter over what survived.

Starting from nothing (not from a copy of the server's environment with bad names removed)
means a credential under a name nobody thought of stays out. The secret filter runs after the
allowlist because allowed prefixes can still carry secrets (`TORCH_HUB_TOKEN`, `HF_TOKEN`-like
names under an allowed prefix, ...), and it looks at values too: a URL with a password in it
(`redis://user:pw@host`) stays out whatever its name.

Vendor-wide prefixes are not allowed: a prefix admits every name anyone invents under it
(`CUDA_CREDS`, `NVIDIA_API_KEY`, `AMD_...`). CUDA's and NVIDIA's runtime knobs are named one by
one from NVIDIA's documentation; prefixes remain only where a library owns the namespace and
reads knobs from it (`TORCHINDUCTOR_`, `TRITON_`, `HSA_`, ...), and those still pass the filter.

Names the server sets on purpose for its own workers (`SERVER_NAMES`: the go-signal token, the
request path, ...) are taken from `extra` as given; they are never copied from the server's own
environment.
"""

from __future__ import annotations

import os
import re
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
        # CUDA toolkit location and build knobs (nvcc, CMake, torch.utils.cpp_extension)
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_ROOT",
        "CUDA_TOOLKIT_ROOT_DIR",
        "CUDA_BIN_PATH",
        "CUDA_INC_PATH",
        "CUDA_VERSION",
        "CUDACXX",
        "CUDAARCHS",
        "CUDAFLAGS",
        # CUDA runtime/driver environment variables (CUDA Programming Guide, "CUDA Environment
        # Variables"): device enumeration, JIT cache, execution, module loading, MPS, coredumps
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUDA_MANAGED_FORCE_DEVICE_ALLOC",
        "CUDA_CACHE_DISABLE",
        "CUDA_CACHE_PATH",
        "CUDA_CACHE_MAXSIZE",
        "CUDA_FORCE_PTX_JIT",
        "CUDA_DISABLE_PTX_JIT",
        "CUDA_FORCE_JIT",
        "CUDA_DISABLE_JIT",
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_DEVICE_MAX_COPY_CONNECTIONS",
        "CUDA_AUTO_BOOST",
        "CUDA_SCALE_LAUNCH_QUEUES",
        "CUDA_GRAPHS_USE_NODE_PRIORITY",
        "CUDA_DEVICE_WAITS_ON_EXCEPTION",
        "CUDA_MODULE_LOADING",
        "CUDA_MODULE_DATA_LOADING",
        "CUDA_PROFILE",
        "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_LOG_DIRECTORY",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "CUDA_MPS_CLIENT_PRIORITY",
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION",
        "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION",
        "CUDA_ENABLE_LIGHTWEIGHT_COREDUMP",
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP",
        "CUDA_COREDUMP_FILE",
        "CUDA_COREDUMP_SHOW_PROGRESS",
        "CUDA_COREDUMP_GENERATION_FLAGS",
        # NVIDIA container runtime / libraries
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
        "NVIDIA_TF32_OVERRIDE",
        # ROCm runtime knobs outside the ROCm-owned prefixes
        "GPU_DEVICE_ORDINAL",
        "GPU_MAX_HW_QUEUES",
        "AMD_DIRECT_DISPATCH",
        "AMD_SERIALIZE_KERNEL",
        "AMD_SERIALIZE_COPY",
        "AMD_LOG_LEVEL",
        "AMD_LOG_MASK",
        "AMD_LOG_LEVEL_FILE",
    }
)

# Set by the server for its own workers (passed in `extra`, never copied from the server's
# environment). They are exempt from the secret filter: the go-signal token is a secret the
# server hands its worker on purpose.
SERVER_NAMES = frozenset(
    {
        "LOOM_GO_SIGNER",
        "LOOM_NONCE",
        "LOOM_REQUEST",
        "LOOM_JOB_DIR",
        "LOOM_RESULT_FD",
        "LOOM_WARM_IDLE_S",
    }
)

# Prefixes copied from the server's environment: namespaces a library owns and reads its knobs
# from (locale, math libraries, ROCm components, Triton, PyTorch). Each ends in "_", so a prefix
# never admits a longer word (TORCH_ admits TORCH_CUDA_ARCH_LIST, not TORCHFOO).
ALLOWED_PREFIXES = (
    "LC_",
    "CUBLAS_",
    "CUBLASLT_",
    "CUDNN_",
    "NVCC_",  # NVCC_APPEND_FLAGS, NVCC_PREPEND_FLAGS, NVCC_CCBIN
    "HIP_",
    "HIPCC_",
    "ROCM_",
    "ROCR_",
    "HSA_",
    "HCC_",
    "MIOPEN_",
    "ROCBLAS_",
    "HIPBLASLT_",
    "AMDGCN_",  # Triton's AMD backend knobs
    "TRITON_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "PYTORCH_",
    "KINETO_",
    "OMP_",
    "KMP_",
    "MKL_",
)

# Dropped even when allowlisted. Matched on the upper-cased name. Broad on purpose: a runtime
# knob lost to a false match costs a tuning option, a credential let through costs the
# credential. (Not "*SIGN*": that is SIGNAL and DESIGN too; the signing words are named.)
SECRET_PATTERNS = (
    "*_TOKEN",
    "*TOKEN*",
    "*_KEY",
    "*_KEY_*",
    "*KEYFILE*",
    "*APIKEY*",
    "*API_KEY*",
    "*SECRET*",
    "*PASS*",  # PASSWORD, PASSWD, PASSPHRASE, DB_PASS, ...
    "*_PWD",
    "*CRED*",  # CREDENTIAL(S), CREDS, ...
    "*_PAT",
    "*AUTH*",
    "*COOKIE*",
    "*SESSION*",
    "*SIGNING*",
    "*SIGNER*",
    "*SIGNATURE*",
    "*CERT*",
    "*PRIVATE*",
    "*BEARER*",
    "*JWT*",
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


# scheme://user:password@host — a credential in a value, whatever the variable is called.
_URL_WITH_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*:[^/?#@\s]+@")


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)


def is_secret_value(value: str) -> bool:
    return _URL_WITH_PASSWORD.search(value) is not None


def is_allowed(name: str) -> bool:
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def worker_env(extra: Mapping[str, str] | None = None, parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker process.

    `parent` defaults to the server's environment; only allowlisted, non-secret names with
    non-secret values are copied. `extra` holds values the server sets on purpose; they override
    copied ones but go through the same secret filter, so a caller cannot forward a credential
    by accident, except SERVER_NAMES, which the server hands its workers deliberately.
    """
    source = os.environ if parent is None else parent
    env = {k: v for k, v in source.items() if is_allowed(k) and not is_secret(k) and not is_secret_value(v)}
    env.setdefault("PATH", _DEFAULT_PATH)
    env.update(FIXED)
    for key, value in (extra or {}).items():
        if key in SERVER_NAMES or not (is_secret(key) or is_secret_value(value)):
            env[key] = value
    return env
