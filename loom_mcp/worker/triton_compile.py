"""Worker: compile the @triton.jit kernels of a file and report their resources.

Triton specializes kernels on argument types, so real compilation needs real arguments: when a
task is given, the candidate's ModelNew runs once on the task's first shape and every kernel it
launched is read back from Triton's cache (registers, spills, shared memory, warps, stages).
Under TRITON_INTERPRET=1 (no GPU) the same run executes the kernels in the interpreter, which
still catches errors with the user's file:line but produces no machine code.

Request: {"source": path, "task": path | None, "device": "auto"}
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from loom_mcp.worker.harness import load_module, pick_device, task_shapes, to_device
from loom_mcp.worker.protocol import read_request, send_result


def _error_location(exc: BaseException, source: str) -> tuple[str | None, int | None]:
    line = getattr(exc, "lineno", None)
    if isinstance(exc, SyntaxError) and exc.filename == source:
        return source, exc.lineno
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == source]
    if frames:
        return source, frames[-1].lineno
    # Triton's CompilationError carries the kernel's source position in its message/attrs.
    src = getattr(exc, "src", None)
    node = getattr(exc, "node", None)
    if node is not None and hasattr(node, "lineno"):
        fn_line = (
            getattr(src, "starting_line_number", None)
            or getattr(getattr(src, "fn", None), "starting_line_number", 0)
            or 0
        )
        return source, int(node.lineno) + int(fn_line)
    return None, line


def _jit_functions(module) -> dict:
    import triton

    # Under TRITON_INTERPRET=1, @triton.jit makes an InterpretedFunction instead.
    kinds: tuple[type, ...] = (triton.runtime.jit.JITFunction,)
    interpreted = getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None)
    if interpreted is not None:
        kinds += (interpreted,)
    found = {}
    for name, value in vars(module).items():
        fn = value
        while fn is not None and not isinstance(fn, kinds):
            fn = getattr(fn, "fn", None)  # Autotuner / Heuristics wrap the JITFunction
        if fn is not None and not isinstance(fn, type):
            found[name] = fn
    return found


def _declared_jit_functions(module, directory: Path) -> dict:
    """The kernels of the candidate's own module, then those of every module it imported from
    its directory (its declared sources), named `module.kernel`; each kernel once."""
    found = _jit_functions(module)
    seen = {id(fn) for fn in found.values()}
    for mod in list(sys.modules.values()):
        origin = getattr(mod, "__file__", None)
        if mod is module or not origin or not Path(origin).resolve().is_relative_to(directory):
            continue
        for name, fn in _jit_functions(mod).items():
            if id(fn) not in seen:
                seen.add(id(fn))
                found[f"{Path(origin).stem}.{name}"] = fn
    return found


def _compiled_kernels(fn) -> list[dict]:
    out = []
    caches = getattr(fn, "device_caches", None) or {}
    for entry in caches.values():
        kernel_cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in kernel_cache.values():
            try:
                kernel._init_handles()
            except Exception:
                pass
            meta = getattr(kernel, "metadata", None)
            out.append(
                {
                    "registers": getattr(kernel, "n_regs", None),
                    "spills": getattr(kernel, "n_spills", None),
                    "shared": getattr(meta, "shared", None),
                    "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                    "target": str(getattr(meta, "target", "")),
                }
            )
    return out


def main() -> None:
    request = read_request() or {}
    source = request["source"]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    result: dict = {
        "kernels": [],
        "error": None,
        "error_file": None,
        "error_line": None,
        "interpreted": interpreted,
        "ran_task": False,
    }
    try:
        import triton

        result["triton"] = triton.__version__
        module = load_module(source, "loom_compile_src")
        jitted = _declared_jit_functions(module, Path(source).resolve().parent)
        if request.get("task") and hasattr(module, "ModelNew"):
            import torch

            from loom_mcp.worker.harness import apply_task_globals, make_case

            try:
                task = load_module(request["task"], "loom_compile_task")
                apply_task_globals(task, request.get("task_globals"), strict=True)
                shape = task_shapes(task)[0]
                inputs, init_inputs = make_case(task, shape, 0, "normal")
            except Exception as exc:  # the task's own failure, before the candidate runs
                result["task_error"] = f"{type(exc).__name__}: {exc}"[-3000:]
                send_result(result)
                return
            device = pick_device(request.get("device"))
            torch.manual_seed(0)
            model = module.ModelNew(*init_inputs)
            if isinstance(model, torch.nn.Module):
                model = model.to(device)
            with torch.no_grad():
                model(*to_device(inputs, device))
            result["ran_task"] = True
            result["shape"] = shape["name"]
        if result["ran_task"]:  # modules the forward imported lazily are loaded now
            jitted = _declared_jit_functions(module, Path(source).resolve().parent)
        for name, fn in jitted.items():
            compiled = [] if interpreted else _compiled_kernels(fn)
            result["kernels"].append({"name": name, "compiled": compiled})
    except Exception as exc:
        file, line = _error_location(exc, source)
        result["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        result["error_file"], result["error_line"] = file, line
    send_result(result)


if __name__ == "__main__":
    main()
