"""The fused optimizer kernels compiled for a CUDA GPU on a machine without one.

Triton's interpreter runs the kernels on the CPU for the tests, but it is lenient: it does
not type-check a kernel as the compiler does, and it never lowers one to a GPU's code. A
kernel that passes every interpreted check can still fail to compile at a GPU's first step.
This tool catches that before a GPU is at hand:

1. In a child process under the interpreter (``TRITON_INTERPRET=1``), it records every
   kernel launch of three fused steps:
   - LAMB's step;
   - 1-bit LAMB's compression step (its first and its second step after the freeze);
   - the same step with the fold and the expansion as passes of their own
     (``expand_in_update`` off).

   Each launch gives a signature: the kernel, each argument's Triton type, and the values
   of its ``tl.constexpr`` arguments. Every other combination of a signature's boolean
   constexprs is added (a fold with a clipping factor, LAMB with bias correction: variants
   the recorded steps do not launch).
2. In this process, in Triton's compiled mode, it compiles every distinct signature for the
   target (``--arch``, default 90: H100 and H200) down to the cubin. Triton ships its own
   ``ptxas``, so no GPU and no CUDA toolkit are needed.

Each signature is compiled with the specialisation Triton's launcher gives it on a GPU:
an argument whose address (or value) is a multiple of 16 is marked so, which lets the
compiler access memory 16 bytes at a time; and with the compiler options the launch
passed (``onebit_bert.kernels.COMPILE_OPTIONS``: FP fusion, explicitly on).

Prints one JSON object: per signature, the kernel, its constexprs, the arguments marked
divisible by 16, the compiler options, whether the recorded steps launched it (or it is an
added combination), the PTX and cubin sizes, its global loads and stores by width (vector:
8 or 16 bytes at a time; scalar), its registers per thread and spilled bytes (``ptxas -v``)
and warps per program, and the error if it failed. Exits 1 if any signature failed. It
runs in a few minutes on 2 cores.

    python -m bench.kernel_compile [--arch 90] [--model bert-tiny] [--vocab-size 300]

To check another Triton (a GPU machine's own), record the launches once with one whose
interpreter runs the kernels, then compile them with the other:

    TRITON_INTERPRET=1 python -m bench.kernel_compile --record launches.json
    PYTHONPATH=<the other Triton> python -m bench.kernel_compile --launches launches.json

A signature compiled here is the launch's types, not its values: Triton's runtime also
specialises on an integer's divisibility by 16 and on a value of 1. Those variants are not
compiled here; they change the code's alignment hints, not what compiles.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make bench importable
    sys.path.insert(0, str(REPO))

MODULES = ("multi_tensor", "signs")
"""The kernel files of ``onebit_bert/kernels/triton_src``."""
STEPS = (("lamb", True), ("onebit_lamb", True), ("onebit_lamb", False))
"""The recorded steps: optimizer and, for 1-bit LAMB, ``expand_in_update``."""


def triton_type(value) -> str:
    """The Triton type of a kernel argument: a tensor's pointer type, or a scalar's."""
    import torch

    if isinstance(value, torch.Tensor):
        names = {
            torch.float32: "fp32",
            torch.float16: "fp16",
            torch.bfloat16: "bf16",
            torch.int64: "i64",
            torch.int32: "i32",
            torch.uint8: "u8",
            torch.int8: "i8",
        }
        if value.dtype not in names:
            raise TypeError(f"no Triton pointer type for a {value.dtype} tensor")
        return "*" + names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def _divisible(value) -> bool:
    """Whether Triton's launcher marks this argument divisible by 16 (a tensor whose
    address is, an integer that is), as it does at a launch on the GPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def memory_accesses(ptx: str) -> dict[str, int]:
    """The global loads and stores of a kernel's PTX, by width: ``vector`` (``.v2``,
    ``.v4``: 8 or 16 bytes at a time) and ``scalar``."""
    counts = {"vector_loads": 0, "scalar_loads": 0, "vector_stores": 0, "scalar_stores": 0}
    for kind, width in re.findall(r"\b(ld|st)\.global((?:\.[a-z0-9]+)*)", ptx):
        access = "loads" if kind == "ld" else "stores"
        vector = ".v2" in width or ".v4" in width
        counts[f"{'vector' if vector else 'scalar'}_{access}"] += 1
    return counts


def registers(ptx: str, arch: int) -> dict[str, int]:
    """What ``ptxas -v`` (the one Triton compiles with) says of a kernel: registers per
    thread and bytes spilled to local memory; empty where that ptxas cannot be found."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except Exception:  # another Triton layout: the figure is left out, not guessed
        return {}
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        out = subprocess.run(
            [ptxas, "-v", f"-arch=sm_{arch}{suffix}", str(source), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
        )
    used = re.search(r"Used (\d+) registers", out.stderr)
    spilled = re.search(r"(\d+) bytes spill stores", out.stderr)
    if out.returncode != 0 or used is None or spilled is None:
        return {}
    return {"registers": int(used.group(1)), "spill_store_bytes": int(spilled.group(1))}


def _module_of(fn) -> str:
    """Which kernel file ``fn`` was defined in."""
    name = getattr(fn, "__module__", "") or ""
    for module in MODULES:
        if name.endswith(f".{module}_interpreted") or name.endswith(f".{module}_compiled"):
            return module
    raise ValueError(f"kernel {fn.__name__} is not from onebit_bert/kernels/triton_src")


def record(model: str, vocab_size: int) -> list[dict]:
    """Every distinct launch signature of the fused steps of :data:`STEPS` on ``model``'s
    parameters (under the interpreter)."""
    import torch
    from triton.runtime import interpreter

    from bench.yardstick import optimizer_on_preset
    from onebit_bert.kernels import triton_module

    seen: dict[str, dict] = {}
    executor = interpreter.GridExecutor
    call = executor.__call__

    def recording(self, *args, **kwargs):
        bound = dict(zip(self.arg_names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        constexprs = {n: bound[n] for n in self.arg_names if n in self.constexprs}
        signature = {
            n: "constexpr" if n in constexprs else triton_type(bound[n]) for n in self.arg_names
        }
        module = _module_of(self.fn)
        # arguments the kernel's file asks Triton not to specialise by value get no hint
        fixed = set(constexprs) | set(getattr(triton_module(module), "UNSPECIALIZED", ()))
        entry = {
            "module": module,
            "kernel": self.fn.__name__,
            "signature": signature,
            "constexprs": constexprs,
            "divisible": [n for n in self.arg_names if n not in fixed and _divisible(bound[n])],
            # the compiler options the launch passed (the interpreter ignores them)
            "options": {k: v for k, v in kwargs.items() if k not in self.arg_names},
        }
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return call(self, *args, **kwargs)

    executor.__call__ = recording
    try:
        for name, in_update in STEPS:
            torch.manual_seed(0)
            opt, _ = optimizer_on_preset(name, model, vocab_size, "cpu")
            opt.set_kernels("fused")
            if hasattr(opt, "expand_in_update"):
                opt.expand_in_update = in_update
            for _ in range(3):  # warmup (1-bit LAMB: its last), then two compressing steps
                opt.step()
    finally:
        executor.__call__ = call
    return list(seen.values())


def with_every_flag(entries: list[dict]) -> list[dict]:
    """``entries`` and, for each, every other combination of its boolean constexprs (a
    variant the recorded steps did not launch, such as a fold with a clipping factor)."""
    out: dict[str, dict] = {}
    for entry in entries:
        flags = [k for k, v in entry["constexprs"].items() if isinstance(v, bool)]
        for values in itertools.product((False, True), repeat=len(flags)):
            flagged = dict(zip(flags, values, strict=True))
            variant = {**entry, "constexprs": {**entry["constexprs"], **flagged}}
            launched = variant["constexprs"] == entry["constexprs"]
            key = json.dumps(variant, sort_keys=True)
            out.setdefault(key, {**variant, "launched": False})
            out[key]["launched"] |= launched
    return list(out.values())


def compile_all(entries: list[dict], arch: int) -> list[dict]:
    """Each recorded signature compiled for CUDA architecture ``arch`` (compiled mode)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onebit_bert.kernels import COMPILE_OPTIONS, triton_module

    target = GPUTarget("cuda", arch, 32)
    results = []
    for entry in entries:
        fn = getattr(triton_module(entry["module"]), entry["kernel"])
        names = list(inspect.signature(fn.fn).parameters)
        constexprs = {(names.index(k),): v for k, v in entry["constexprs"].items()}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in entry["divisible"]}
        row = {
            "kernel": entry["kernel"],
            "constexprs": entry["constexprs"],
            "divisible_by_16": entry["divisible"],
            "launched": entry.get("launched", True),
            "options": entry.get("options", COMPILE_OPTIONS),
        }
        started = time.perf_counter()
        try:
            source = _source(ASTSource, fn, entry, names, constexprs, attrs)
            # launches recorded before the options were: those every launch now passes
            options = entry.get("options", COMPILE_OPTIONS)
            compiled = triton.compile(source, target=target, options=dict(options))
            row["ptx_bytes"] = len(compiled.asm["ptx"])
            row["cubin_bytes"] = len(compiled.asm["cubin"])
            row.update(memory_accesses(compiled.asm["ptx"]))
            row.update(registers(compiled.asm["ptx"], arch))
            row["num_warps"] = compiled.metadata.num_warps
        except Exception as err:  # one failure must not hide the others
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
        row["seconds"] = round(time.perf_counter() - started, 2)
        results.append(row)
    return results


def _source(ast_source, fn, entry: dict, names: list[str], constexprs: dict, attrs: dict):
    """The compiler's input for one signature: Triton 3.3 and later take the constexprs
    and attributes by argument position; 3.2 takes the constexprs by name and the
    divisibility hints as an ``AttrsDescriptor``."""
    parameters = inspect.signature(ast_source.__init__).parameters
    if "constexprs" in parameters:
        return ast_source(fn=fn, signature=entry["signature"], constexprs=constexprs, attrs=attrs)
    from triton.backends.compiler import AttrsDescriptor

    hints = {names.index(n): 16 for n in entry["divisible"]}
    return ast_source(
        fn=fn,
        signature=entry["signature"],
        constants=dict(entry["constexprs"]),
        attrs=AttrsDescriptor.from_hints(hints),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernel_compile", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--arch", type=int, default=90, help="CUDA compute capability × 10 (default: 90)"
    )
    parser.add_argument("--model", default="bert-tiny", help="the parameters' preset")
    parser.add_argument("--vocab-size", type=int, default=300, help="embedding rows (300)")
    parser.add_argument(
        "--record",
        type=Path,
        help="only record the launches, as JSON, to this file (under TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--launches",
        type=Path,
        help="compile the launches --record wrote to this file instead of recording them "
        "(e.g. with another Triton than the one that recorded them)",
    )
    args = parser.parse_args(argv)
    from onebit_bert.kernels import interpreter_problem, interpreting, triton_available

    if not triton_available():
        parser.error("needs Triton (pip install '.[gpu]')")
    if args.launches is None and interpreter_problem() is not None:  # records in it
        parser.error(f"{interpreter_problem()}; or --launches from a recording made there")
    if args.record is not None:
        if not interpreting():
            parser.error("--record runs under TRITON_INTERPRET=1")
        partial = args.record.with_name(args.record.name + ".tmp")
        partial.write_text(json.dumps(record(args.model, args.vocab_size)))
        os.replace(partial, args.record)  # no half-written recording
        return 0
    if interpreting():
        parser.error("compiling needs Triton's compiled mode: unset TRITON_INTERPRET")
    if args.launches is not None:
        try:
            entries = json.loads(args.launches.read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"--launches {args.launches}: {err} (write one with --record)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "launches.json"
            env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
            command = [sys.executable, "-m", "bench.kernel_compile", "--model", args.model,
                       "--vocab-size", str(args.vocab_size), "--record", str(path)]  # fmt: skip
            child = subprocess.run(command, cwd=REPO, env=env)
            if child.returncode != 0:
                return child.returncode
            entries = json.loads(path.read_text())
    return _report(compile_all(with_every_flag(entries), args.arch), args.arch)


def _report(results: list[dict], arch: int) -> int:
    """Print the JSON line; 1 if any signature failed."""
    import triton

    failed = [r for r in results if "error" in r]
    print(
        json.dumps(
            {
                "benchmark": "kernel_compile",
                "arch": arch,
                "triton": triton.__version__,
                "signatures": len(results),
                "failed": len(failed),
                "kernels": results,
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
