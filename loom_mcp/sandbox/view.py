"""What a sandboxed job sees of the file system: the allowlist its root is built from.

A job does not get the host's tree, read-only or not: init of its pid namespace builds a root
of its own on a tmpfs (mounts._build_root) holding only

* the system: /usr, /bin, /sbin, /lib* (symlinks into /usr recreated as symlinks), /sys;
* the interpreter: the server's prefixes and every sys.path directory (the launcher runs with
  -I -S and cannot know them), editable installs, GPU toolkits (/usr/local/cuda*, /opt/rocm*,
  the directories of nvcc, hipcc, ninja, the profilers), LD_LIBRARY_PATH;
* a curated /etc (the dynamic loader's cache, passwd/group, name resolution, time zone, CA
  certificates, ...), never shadow, gshadow, sudoers or ssh;
* a minimal /dev (null, zero, full, random, urandom, tty, pts, fd links) plus the GPU nodes;
  a fresh /proc; private tmpfs on /tmp, /run and /dev/shm;
* the job's own paths: `readable` read-only, its directory and `writable` read-write, all at
  the same absolute paths as on the host.

That is what keeps a job away from host Unix sockets (an AF_UNIX path is a file: the network
namespace does not cover it), the ledger, other campaigns' files, $HOME and /etc/shadow.
Anything secret inside a directory bound as a whole (LOOM_HOME under an allowed root, the
credentials under a home directory that is one) is masked with an empty read-only mount.

The launcher is standard-library only and knows nothing of the server, so the server computes
the plan and hands it over as a list of entries that init applies in order:

    {"op": "tmpfs", "path", "options", "readonly"}    a private tmpfs
    {"op": "bind", "path", "src", "mode": "ro"|"rw", "optional"}
    {"op": "symlink", "path", "target"}
    {"op": "mask", "path"}                            an empty read-only tmpfs, or /dev/null
    {"op": "proc", "path"} / {"op": "devpts", "path"}

Paths are real (the symlinks met on the way are recreated as entries of their own) and the
entries are sorted parents first, so every mount point exists when its turn comes: a
directory inside a bind exists on the host, one in a tmpfs is created.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loom_mcp.sandbox import policy

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# What programs read from /etc. Not: shadow, gshadow, sudoers*, ssh/, ssl/private, machine-id,
# the package manager's state, anything with credentials.
ETC_ALLOWLIST = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "passwd",
    "group",
    "hosts",
    "host.conf",
    "nsswitch.conf",
    "resolv.conf",
    "gai.conf",
    "protocols",
    "services",
    "localtime",
    "timezone",
    "os-release",
    "lsb-release",
    "debian_version",
    "redhat-release",
    "system-release",
    "alternatives",
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates",
    "ca-certificates.conf",
    "pki/tls/certs",
    "pki/ca-trust",
    "mime.types",
    "fonts",
    "gitconfig",
    "OpenCL/vendors",
    "nvidia",
    "vulkan",
    "profile",
    "bash.bashrc",
    "shells",
    "login.defs",
    "inputrc",
)

DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
GPU_NODES = ("/dev/nvidia*", "/dev/dri", "/dev/kfd")

# Tools a job may run, found on the server's PATH (which the worker inherits): each one's
# install directory is bound (a toolkit root for compilers under a `bin`, the version directory
# of the Nsight tools).
TOOLS = (
    "nvcc",
    "hipcc",
    "ptxas",
    "cuobjdump",
    "nvdisasm",
    "ncu",
    "nsys",
    "rocprofv3",
    "rocprof",
    "ninja",
    "cc",
    "gcc",
    "c++",
    "g++",
    "clang",
    "ld",
    "as",
    "ldconfig",
    "git",
)
TOOLKIT_GLOBS = ("/usr/local/cuda*", "/opt/rocm*", "/opt/cuda*")
TOOLKIT_ENV = ("CUDA_HOME", "CUDA_PATH", "ROCM_PATH", "ROCM_HOME", "HIP_PATH")
# Compilers named by the environment (Triton builds its launcher with $CC, torch's
# cpp_extension uses $CXX): a toolchain outside PATH, such as /opt/gcc/bin/gcc.
TOOL_ENV = ("CC", "CXX", "NVCC", "CUDACXX", "CUDAHOSTCXX", "HIPCC")
# Trees under which a tool's own directory is bound, never their prefix as a whole.
_SHARED_PREFIXES = ("/", "/usr", "/usr/local", "/opt", "/bin", "/sbin", "/usr/bin", "/usr/sbin")

# Credentials under a home directory, masked when a trusted job's allowed root contains it.
HOME_SECRETS = (
    ".ssh",
    ".gnupg",
    ".aws",
    ".azure",
    ".config/gcloud",
    ".config/gh",
    ".config/hub",
    ".docker",
    ".kube",
    ".netrc",
    ".git-credentials",
    ".pypirc",
    ".npmrc",
    ".yarnrc",
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".huggingface",
    ".cache/huggingface/token",
    ".cache/huggingface/stored_tokens",
    ".config/huggingface",
    ".bash_history",
    ".zsh_history",
    ".python_history",
    ".lesshst",
    ".local/share/keyrings",
    ".password-store",
    ".vault-token",
    ".terraform.d",
    ".claude",
    ".claude.json",
    ".codex",
    ".config/anthropic",
    ".config/openai",
    ".wandb",
    ".netrc.gpg",
    ".mozilla",
    ".config/google-chrome",
    ".config/chromium",
)

_KIND_ORDER = {"tmpfs": 0, "mask": 0, "proc": 0, "bind": 1, "devpts": 1, "symlink": 2}


def _resolve(path: str) -> tuple[str, list[tuple[str, str]]]:
    """The real path of `path`, and each symlink met on the way as (where it is, its target)."""
    todo = [p for p in reversed(os.path.abspath(path).split("/")) if p]
    real, links, hops = "/", [], 0
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            real = os.path.dirname(real)
            continue
        candidate = os.path.join(real, name)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise OSError(f"too many symlinks in {path}")
            target = os.readlink(candidate)
            links.append((candidate, target))
            if target.startswith("/"):
                real = "/"
            todo.extend(p for p in reversed(target.split("/")) if p)
        else:
            real = candidate
    return real, links


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


class Plan:
    """Entries for one root; binds are merged per path, the rest sorted in at the end."""

    def __init__(self, never: Iterable[str] = ()) -> None:
        self.binds: dict[str, dict[str, Any]] = {}  # path -> entry
        self.entries: list[dict[str, Any]] = []  # everything else
        self.links: dict[str, str] = {}
        # Never bound as system paths (the host's root, $HOME, LOOM_HOME and their parents):
        # binding one would bring in everything the view leaves out.
        self.never = {"/", *never}

    def bind(
        self,
        path: str | os.PathLike,
        mode: str = "ro",
        *,
        optional: bool = False,
        system: bool = False,
        dst: str | None = None,
    ) -> None:
        """Bind `path` at the same place (or at `dst`). A `system` path is skipped when an
        ancestor is bound already, or when it is (a parent of) $HOME or LOOM_HOME; a job's own
        paths are always bound, and what they contain of LOOM_HOME is masked (see `mask`)."""
        try:
            real, links = _resolve(os.fspath(path))
            if not os.path.exists(real):
                raise FileNotFoundError(f"{path} does not exist")
        except OSError:
            if optional:
                return
            raise
        if real == "/" and dst is None:
            if optional:
                return
            raise ValueError("refusing to show the host's whole tree to a job")
        target = dst or real
        if system and real in self.never:
            return
        if dst is None:  # the path as the job names it leads to the real one
            for where, to in links:
                self.links[where] = to
        if system:
            for other, bound in self.binds.items():
                if bound["src"] == other and _under(real, other) and bound["mode"] == mode:
                    return
        entry = self.binds.get(target)
        if entry is not None:
            if mode == "rw":
                entry["mode"] = "rw"
            entry["optional"] = entry["optional"] and optional
            return
        self.binds[target] = {"op": "bind", "path": target, "src": real, "mode": mode, "optional": optional}

    def add(self, op: str, path: str, **fields: Any) -> None:
        self.entries.append({"op": op, "path": path, **fields})

    def symlink(self, path: str, target: str) -> None:
        self.links[path] = target

    def mask(self, hidden: Iterable[Path]) -> None:
        """Cover each hidden path that lies inside a bound directory (not one bound itself)."""
        for path in hidden:
            try:
                real, _ = _resolve(str(path))
            except OSError:
                continue
            if not os.path.exists(real) or real in self.binds:
                continue
            if any(_under(real, b) and real != b for b in self.binds):
                self.add("mask", real)

    def entries_sorted(self) -> list[dict[str, Any]]:
        links = [{"op": "symlink", "path": p, "target": t} for p, t in self.links.items() if p not in self.binds]
        return sort_entries([*self.entries, *self.binds.values(), *links])


def sort_entries(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parents first, so that every mount point exists when its turn comes."""
    return sorted(
        entries, key=lambda e: (e["path"].count("/") if e["path"] != "/" else 0, _KIND_ORDER[e["op"]], e["path"])
    )


def late_entries(base: list[dict[str, Any]], full: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a root built from `base` lacks of `full` (a pre-started worker given its job's
    paths). Raises ValueError when an entry would cover one the root already has (it would
    hide the worker's own directory, say): that job needs a root built from scratch."""
    late = [e for e in full if e not in base]
    for entry in late:
        if entry["op"] in ("proc", "devpts"):
            raise ValueError(f"{entry['op']} {entry['path']} cannot be added later")
        inside = entry["path"].rstrip("/") + "/"
        covered = next((b["path"] for b in base if b["path"].startswith(inside)), None)
        if covered is not None:
            raise ValueError(f"{entry['path']} would cover {covered}")
    return sort_entries(late)


def _editable_roots(paths: Iterable[str]) -> list[str]:
    """Package directories of editable installs: setuptools' finder modules map package names
    to source trees outside site-packages (loom-mcp itself in a development checkout)."""
    found = []
    for entry in paths:
        for finder in glob.glob(os.path.join(glob.escape(entry), "__editable__*finder.py")):
            try:
                text = Path(finder).read_text()
            except OSError:
                continue
            match = re.search(r"^MAPPING\s*(?::[^=\n]*)?=\s*(\{.*?\})\s*$", text, re.M)
            if not match:
                continue
            try:
                mapping = ast.literal_eval(match.group(1))
            except (ValueError, SyntaxError):
                continue
            found += [str(v) for v in mapping.values() if isinstance(v, str)]
    return found


# Never a system path as a whole: the view's own private mounts, and trees that hold more than
# any job needs. (A server started as `python some/dir/script.py` has that directory on
# sys.path: /tmp, once.)
_NEVER_SYSTEM = (
    "/tmp",
    "/var/tmp",
    "/dev",
    "/dev/shm",
    "/proc",
    "/sys",
    "/run",
    "/etc",
    "/var",
    "/home",
    "/mnt",
    "/media",
    "/srv",
    "/opt",
    "/root",
)


def _never() -> set[str]:
    """$HOME, LOOM_HOME and their parents, and _NEVER_SYSTEM: never bound as system paths."""
    out: set[str] = set(_NEVER_SYSTEM)
    for path in (Path.home(), policy.current().loom_home):
        if path is None:
            continue
        try:
            real = os.path.realpath(path)
        except OSError:
            continue
        out.add(real)
        out.update(str(p) for p in Path(real).parents)
    return out


def _tool_dirs() -> list[str]:
    home = os.path.realpath(Path.home())
    found: list[tuple[str, str]] = [(tool, shutil.which(tool) or "") for tool in TOOLS]
    for name in TOOL_ENV:
        # "$CC" may carry flags ("gcc -m64"): its first word is the program.
        words = os.environ.get(name, "").split()
        if words:
            found.append((os.path.basename(words[0]), shutil.which(words[0]) or ""))
    dirs = []
    for tool, where in found:
        if not where:
            continue
        # Both the name as found and its real path: a PATH entry may be a link farm.
        for path in dict.fromkeys((os.path.abspath(where), os.path.realpath(where))):
            real = Path(path)
            root = real.parent
            if tool in ("nsys", "ncu"):
                root = root.parent  # .../nsight-systems-<version>/target-linux-x64/nsys
            elif root.name == "bin" and str(root.parent) not in _SHARED_PREFIXES:
                # A toolchain of its own (/usr/local/cuda, /opt/gcc, a conda env): its lib/,
                # libexec/ and include/ come with it (gcc runs cc1 from libexec).
                root = root.parent
            if _under(str(root), home):
                root = real.parent  # under $HOME bind the tool's own directory, no more
            dirs.append(str(root))
    return list(dict.fromkeys(dirs))


@functools.cache
def _system_plan() -> tuple[tuple[str, Any], ...]:
    """System binds and symlinks, computed once per server process: (kind, args) pairs."""
    import loom_mcp

    items: list[tuple[str, Any]] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            items.append(("symlink", (path, os.readlink(path))))
        elif os.path.isdir(path):
            items.append(("bind", (path, False)))
    python = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *(p for p in sys.path if p and os.path.isabs(p)),
        *_editable_roots(p for p in sys.path if p and os.path.isdir(p)),
        os.path.dirname(os.path.abspath(loom_mcp.__file__)),
    ]
    items += [("bind", (p, True)) for p in python]
    toolkits = [p for pattern in TOOLKIT_GLOBS for p in sorted(glob.glob(pattern))]
    toolkits += [os.environ[name] for name in TOOLKIT_ENV if os.environ.get(name)]
    toolkits += _tool_dirs()
    toolkits += [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if os.path.isabs(p)]
    items += [("bind", (p, True)) for p in toolkits]
    items += [("bind", (os.path.join("/etc", name), True)) for name in ETC_ALLOWLIST]
    return tuple(items)


def system_paths() -> list[Path]:
    """The host directories every job sees (read-only), as real paths."""
    plan = Plan(_never())
    _add_system(plan)
    return [Path(p) for p in plan.binds]


def _add_system(plan: Plan) -> None:
    for kind, args in _system_plan():
        if kind == "symlink":
            plan.symlink(*args)
        else:
            path, optional = args
            plan.bind(path, "ro", optional=optional, system=True)


def hidden_paths(extra: Iterable[Path] = ()) -> list[Path]:
    """What is masked where a bound directory contains it: LOOM_HOME, credentials under $HOME."""
    home = Path.home()
    return [*policy.current().hidden(), *(home / name for name in HOME_SECRETS), *extra]


def job_view(
    *,
    job_dir: Path,
    readable: Iterable[Path] = (),
    writable: Iterable[Path] = (),
    shm_dir: Path | None = None,
    tmp_bytes: int = 1 << 30,
    hidden: Iterable[Path] = (),
) -> list[dict[str, Any]]:
    """The entries of one job's root (see the module docstring). `tmp_bytes` sizes the private
    /tmp and /dev/shm tmpfs (the job's disk quota: they hold files too)."""
    plan = Plan(_never())
    _add_system(plan)
    plan.bind("/sys", "ro", optional=True)
    plan.add("proc", "/proc", optional=True)
    plan.add("tmpfs", "/dev", options="size=64k,mode=0755", readonly=False)
    for name in DEV_NODES:
        plan.bind(f"/dev/{name}", "rw", optional=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        plan.symlink(f"/dev/{name}", target)
    plan.add("devpts", "/dev/pts", optional=True)
    for pattern in GPU_NODES:
        for node in sorted(glob.glob(pattern)):
            plan.bind(node, "rw", optional=True)
    size = max(int(tmp_bytes), 1 << 20)
    if shm_dir is not None:
        # One benchmark's processes share POSIX shared memory and CUDA IPC files through it.
        plan.bind(shm_dir, "rw", dst="/dev/shm")
    else:
        plan.add("tmpfs", "/dev/shm", options=f"size={size},mode=1777", readonly=False)
    plan.add("tmpfs", "/tmp", options=f"size={size},mode=1777", readonly=False)
    plan.symlink("/var/tmp", "/tmp")
    plan.add("tmpfs", "/run", options="size=16m,mode=0755", readonly=False)
    # The job's own paths, after the private /tmp: a socket directory under /tmp stays reachable.
    for path in readable:
        plan.bind(path, "ro", optional=True)  # a missing one fails in the job, as it would outside
    for path in (job_dir, *writable):
        plan.bind(path, "rw")
    plan.mask(hidden_paths(hidden))
    return plan.entries_sorted()
