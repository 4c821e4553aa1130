#!/usr/bin/env python3
"""The CUDA Q4_K GEMV's consumer loop in SASS, counted without a GPU.

    python kernels/tools/sass_q4k_gemv.py [--candidate PATH] [--kernel b1|bn] [--sass FILE]

Builds the GEMV's CUDA source (kernels/q4k_gemv/q4k_gemv.cu, or another checkout's; an older
single-file candidate.py's `CUDA_SOURCE` string too) with `nvcc -cubin` for sm_90 (as the kernel object builds
it: -O3, MIN_CTAS=2), disassembles one kernel with `cuobjdump -sass`, finds the loop around its
integer MMAs (the consumers' per-block loop: from the target of the first backward branch after
the last IMMA to that branch) and prints its length and instruction mix, with ptxas's register
count. `--sass FILE` reads a saved `cuobjdump -sass` listing instead of building.

Where the tools come from: nvcc from the CUDA toolkit; cuobjdump ($CUOBJDUMP, PATH, or beside
nvcc) also from the `nvidia-cuda-cuobjdump` wheel (`pip download --no-deps
nvidia-cuda-cuobjdump`, then unzip: nvidia/cu13/bin/cuobjdump).
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNELS = {  # kernel -> mangled name (the signatures of kernels/q4k_gemv/q4k_gemv.cu)
    "b1": "_Z18q4k_gemv_b1_kernelILb1EEvPKhPKtPtiiiii",  # K a whole number of chunks
    "b1_partial": "_Z18q4k_gemv_b1_kernelILb0EEvPKhPKtPtiiiii",
    "bn": "_Z18q4k_gemv_bn_kernelPKhPKtPtPfiiiiii",
}
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction of a `cuobjdump -sass` listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    """The opcode without predicate and modifiers: '@!P0 LOP3.LUT R1, ...' -> 'LOP3'."""
    words = text.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def consumer_loop(sass: str) -> list[tuple[int, str]]:
    """The instructions of the loop that holds the kernel's IMMAs: from the target of the first
    backward branch at or after the last IMMA, when that target lies at or before the first
    IMMA, through the branch."""
    code = instructions(sass)
    mma = [i for i, (_, text) in enumerate(code) if opcode(text) == "IMMA"]
    if not mma:
        raise ValueError("no IMMA in this listing: not the tensor-core GEMV")
    first_address = code[mma[0]][0]
    for i in range(mma[-1], len(code)):
        if opcode(code[i][1]) != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)\s*$", code[i][1])
        if target and int(target.group(1), 16) <= first_address:
            start = next(j for j, (address, _) in enumerate(code) if address == int(target.group(1), 16))
            return code[start : i + 1]
    raise ValueError("no backward branch closes a loop around the IMMAs")


def summary(loop: list[tuple[int, str]]) -> dict:
    mix = collections.Counter(opcode(text) for _, text in loop)
    return {
        "instructions": len(loop),
        "imma": mix.get("IMMA", 0),
        "from": hex(loop[0][0]),
        "to": hex(loop[-1][0]),
        "mix": dict(mix.most_common()),
    }


def find_cuobjdump() -> str | None:
    for candidate in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")):
        if candidate and Path(candidate).exists():
            return candidate
    nvcc = shutil.which("nvcc")
    beside = Path(nvcc).parent / "cuobjdump" if nvcc else None
    return str(beside) if beside and beside.exists() else None


def cuda_source(candidate: Path) -> str:
    """The CUDA source: a .cu file's text, or an older candidate.py's CUDA_SOURCE string, read
    without importing it (no torch needed)."""
    if candidate.suffix != ".py":
        return candidate.read_text()
    for node in ast.parse(candidate.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CUDA_SOURCE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{candidate} has no CUDA_SOURCE")


def build_and_disassemble(candidate: Path, kernel: str) -> tuple[str, dict[str, int]]:
    """The kernel's SASS and ptxas's registers per kernel, from a fresh `nvcc -cubin`."""
    cuobjdump = find_cuobjdump()
    if shutil.which("nvcc") is None or cuobjdump is None:
        raise SystemExit("needs nvcc and cuobjdump (see the docstring for where to get cuobjdump)")
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "q4k.cu", Path(tmp) / "q4k.cubin"
        source.write_text(cuda_source(candidate))
        built = subprocess.run(
            ["nvcc", "-cubin", "-arch=sm_90", "-O3", "-DMIN_CTAS=2", "-Xptxas", "-v", "-o", str(cubin), str(source)],
            capture_output=True, text=True, check=True,
        )
        registers, current = {}, None
        for line in built.stderr.splitlines():  # ptxas names a function, then its registers
            named = re.search(r"Compiling entry function '(\w+)'", line)
            current = named.group(1) if named else current
            used = re.search(r"Used (\d+) registers", line)
            if used and current:
                registers[current] = int(used.group(1))
        sass = subprocess.run(
            [cuobjdump, "-sass", "-fun", KERNELS[kernel], str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return sass, registers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidate", type=Path, default=REPO / "kernels/q4k_gemv/q4k_gemv.cu")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="b1")
    parser.add_argument("--sass", type=Path, help="a saved cuobjdump -sass listing instead of a build")
    args = parser.parse_args()
    if args.sass:
        sass, registers = args.sass.read_text(), {}
    else:
        sass, registers = build_and_disassemble(args.candidate, args.kernel)
    named = re.search(r"Function : (\S+)", sass)  # a saved listing names its own kernel
    name = named.group(1) if args.sass and named else KERNELS[args.kernel]
    result = {"kernel": name, **summary(consumer_loop(sass))}
    if name in registers:
        result["registers"] = registers[name]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
