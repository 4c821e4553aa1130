"""The static checks let a candidate read its own declared SOURCES, named from `__file__` and
literals, and nothing else: every other read, open or write stays a static.io error."""

from __future__ import annotations

import pytest

from loom_mcp.validate.static_checks import check_candidate_source, has_errors

HEAD = 'import os\nfrom pathlib import Path\n\nSOURCES = ["gemv.cu", "include/gemv.cuh"]\n'


def io_errors(body: str, **kwargs) -> list[str]:
    found = check_candidate_source(HEAD + body, "cand.py", **kwargs)
    return [f.message for f in found if f.check == "static.io" and f.severity == "error"]


@pytest.mark.parametrize(
    "body",
    [
        'SRC = Path(__file__).with_name("gemv.cu").read_text()\n',
        'SRC = (Path(__file__).parent / "gemv.cu").read_text(encoding="utf-8")\n',
        'SRC = Path(__file__).resolve().parent.joinpath("include", "gemv.cuh").read_bytes()\n',
        'HERE = Path(__file__).parent\nSRC = (HERE / "include" / "gemv.cuh").read_text()\n',
        'KERNEL = Path(__file__).with_name("gemv.cu")\n\ndef source():\n    return KERNEL.read_text()\n',
        'SRC = open(os.path.join(os.path.dirname(__file__), "gemv.cu")).read()\n',
        'SRC = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv.cu"), "rb").read()\n',
        'with Path(__file__).with_name("gemv.cu").open(mode="rt") as f:\n    SRC = f.read()\n',
        'SRC = open(str(Path(__file__).with_name("gemv.cu")), encoding="utf-8").read()\n',
    ],
)
def test_reading_a_declared_source_is_allowed(body: str):
    assert io_errors(body) == []


@pytest.mark.parametrize(
    "body,what",
    [
        # not declared, or not below the candidate's directory
        ('SRC = Path(__file__).with_name("other.cu").read_text()\n', "touches no files"),
        ('SRC = (Path(__file__).parent / "../gemv.cu").read_text()\n', "touches no files"),
        ('SRC = (Path(__file__).parent / "/tmp/gemv.cu").read_text()\n', "touches no files"),
        ('SRC = Path(__file__).parent.parent.joinpath("gemv.cu").read_text()\n', "touches no files"),
        ('SRC = Path("gemv.cu").read_text()\n', "touches no files"),
        ('SRC = open("/dev/shm/results.bin", "rb").read()\n', "opens no files"),
        ("SRC = Path(__file__).read_text()\n", "touches no files"),
        # a computed name, however it is computed
        ('NAME = "gemv" + ".cu"\nSRC = Path(__file__).with_name(NAME).read_text()\n', "touches no files"),
        ("def load(name):\n    return (Path(__file__).parent / name).read_text()\n", "touches no files"),
        ("SRC = Path(__file__).with_name(f\"{'gemv'}.cu\").read_text()\n", "touches no files"),
        ('HERE = Path(__file__).parent\nHERE = Path("/tmp")\nSRC = (HERE / "gemv.cu").read_text()\n', "no files"),
        # the anchors rebound: __file__, Path, or a star import that could rebind either
        ('__file__ = "/tmp/cand.py"\nSRC = Path(__file__).with_name("gemv.cu").read_text()\n', "no files"),
        ('def Path(p):\n    return p\nSRC = Path(__file__).with_name("gemv.cu").read_text()\n', "no files"),
        ('from os.path import *\nSRC = Path(__file__).with_name("gemv.cu").read_text()\n', "no files"),
        # writes to a declared source, and opens that may write
        ('Path(__file__).with_name("gemv.cu").write_text("")\n', "only reads its sources"),
        ('(Path(__file__).parent / "gemv.cu").unlink()\n', "only reads its sources"),
        ('open(Path(__file__).with_name("gemv.cu"), "w").close()\n', "only reads its sources"),
        ('open(Path(__file__).with_name("gemv.cu"), mode="r+").close()\n', "only reads its sources"),
        ('MODE = "r"\nopen(Path(__file__).with_name("gemv.cu"), MODE).close()\n', "only reads its sources"),
        ('Path(__file__).with_name("gemv.cu").open("ab").close()\n', "only reads its sources"),
        ('open(Path(__file__).with_name("gemv.cu"), opener=os.open).close()\n', "opens no files"),
        # the opener by position; a swapped-in writer called as a reader
        ('open(Path(__file__).with_name("gemv.cu"), "r", -1, None, None, None, True, os.open)\n', "opens no files"),
        ('Path(__file__).with_name("gemv.cu").read_text("payload")\n', "only reads its sources"),
        # the unbound method, and any receiver at all
        ('import pathlib\nREAD = pathlib.Path.read_text\nSRC = READ(Path("/etc/passwd"))\n', "no files"),
        ("def f(p):\n    return p.read_bytes()\n", "touches no files"),
    ],
)
def test_every_other_file_access_is_an_error(body: str, what: str):
    errors = io_errors(body)
    assert errors and any(what in message for message in errors), errors


def test_without_sources_nothing_is_readable():
    body = 'SRC = Path(__file__).with_name("gemv.cu").read_text()\n'
    found = check_candidate_source("from pathlib import Path\n" + body)
    assert any(f.check == "static.io" and f.severity == "error" for f in found)


def test_a_declared_helper_reads_what_the_caller_says_the_candidate_declared():
    """A helper module has no SOURCES of its own; the candidate's list (relative to the helper's
    directory) is passed, and it replaces the helper's own."""
    helper = 'from pathlib import Path\n\nSRC = Path(__file__).with_name("gemv.cu").read_text()\n'
    assert has_errors(check_candidate_source(helper, "helper.py"))
    assert not has_errors(check_candidate_source(helper, "helper.py", declared_sources=["gemv.cu"]))
    assert has_errors(check_candidate_source(helper, "helper.py", declared_sources=["other.cu"]))
    own = 'SOURCES = ["gemv.cu"]\n' + helper
    assert has_errors(check_candidate_source(own, "helper.py", declared_sources=[]))


def test_rebinding_a_modules_file_is_an_error():
    found = check_candidate_source('import helper\n\nhelper.__file__ = "/tmp/x.py"\n')
    assert any(f.check == "static.monkeypatch" and f.severity == "error" for f in found)
    found = check_candidate_source('import helper\n\nsetattr(helper, "__file__", "/tmp/x.py")\n')
    assert any(f.check == "static.monkeypatch" and f.severity == "error" for f in found)


def test_a_declared_native_source_is_scanned_like_inline_source():
    cu = (
        '#include <cstdio>\n\n__global__ void k(float* y) { y[0] = 1.0f; }\nvoid dump() { fopen("/dev/shm/y", "w"); }\n'
    )
    found = check_candidate_source(cu, "gemv.cu")
    assert [(f.check, f.severity, f.line) for f in found if f.severity == "error"] == [
        ("static.io", "error", 4),
        ("static.io", "error", 4),
    ]
    assert not any(f.check == "static.no_kernel" for f in found)
    header = check_candidate_source("#pragma once\nstruct Tile { int rows; };\n", "include/gemv.cuh")
    assert [f.check for f in header] == ["static.no_kernel"]  # a header: no kernel of its own


def test_the_sandbox_reads_sources_as_the_checks_do(tmp_path):
    from loom_mcp.errors import LoomError
    from loom_mcp.sandbox.sources import declared_sources

    (tmp_path / "gemv.cu").write_text("__global__ void k() {}\n")
    cand = tmp_path / "cand.py"
    cand.write_text('SOURCES: list[str] = ["./gemv.cu"]\nSOURCES = ["elsewhere.cu"]\n')
    assert declared_sources(cand) == [tmp_path / "gemv.cu"]  # the first binding, as declared.py
    cand.write_text("SOURCES = [NAME]\n")
    with pytest.raises(LoomError, match="literal list"):
        declared_sources(cand)


@pytest.mark.parametrize(
    "body,check",
    [
        # a declared source's text run as code: what the checks read of the candidate is not all it runs
        ('import timeit\ntimeit.timeit(Path(__file__).with_name("gemv.cu").read_text(), number=1)\n',
         "static.dynamic_code"),
        ('import cProfile\ncProfile.run(Path(__file__).with_name("gemv.cu").read_text())\n', "static.dynamic_code"),
        # module-level locals() is the module's namespace: a checked name rebound through it
        ('K = Path(__file__).with_name("gemv.cu")\nlocals()["K"] = Path("/etc/passwd")\nS = K.read_text()\n',
         "static.grader_introspection"),
    ],
)
def test_running_or_rebinding_what_was_read_is_an_error(body: str, check: str):
    found = check_candidate_source(HEAD + body, "cand.py")
    assert any(f.check == check and f.severity == "error" for f in found), [f.check for f in found]

