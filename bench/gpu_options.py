"""The options of ``python -m bench.gpu`` (:mod:`bench.gpu`): the parser, with a help
text per option, and the checks that stop a bad combination before anything runs."""

from __future__ import annotations

import argparse
from pathlib import Path

OPTIMIZERS = ("lamb", "onebit_lamb", "adamw")
IMPLS = ("reference", "fused", "fused-separate")
PRECISIONS = ("bf16", "fp16", "fp32")
MODELS = ("bert-large", "bert-base", "bert-small", "bert-mini", "bert-tiny")
SEQ_LENGTHS = (128, 512)
DESCRIPTION = (
    "BERT-Large training throughput and peak memory on one GPU at sequence lengths 128 and "
    "512, ours vs HF Trainer."
)


def comma_list(choices: tuple[str, ...]):
    """An argparse type: a comma-separated list whose items are all in ``choices``."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}; got {text!r}"
            )
        return list(dict.fromkeys(items))

    return parse


def build_parser() -> argparse.ArgumentParser:
    from bench.common import add_data_root

    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=DESCRIPTION,
        epilog="Needs a CUDA GPU (without one it says so and exits with status 1). The first "
        "visible GPU is used; choose it with CUDA_VISIBLE_DEVICES.",
    )
    parser.add_argument(
        "--corpus",
        choices=("generated", "wikipedia"),
        default="generated",
        help="generated (default): the smoke corpus, written here, no files needed; "
        "wikipedia: the sample under --data-root with BERT's vocabulary",
    )
    add_data_root(
        parser,
        help="with --corpus wikipedia: folder holding the Wikipedia sample and the BERT "
        "vocabulary (default: $DATA_ROOT or ../shared/data)",
    )
    parser.add_argument(
        "--prepared",
        type=Path,
        default=None,
        help="a folder the data stage already wrote with the sequence lengths asked for "
        "(skips preparing)",
    )
    parser.add_argument(
        "--seq-lengths",
        type=comma_list(tuple(str(n) for n in SEQ_LENGTHS)),
        default=[str(n) for n in SEQ_LENGTHS],
        help="comma list of 128, 512 (default: both)",
    )
    parser.add_argument(
        "--precisions",
        type=comma_list(PRECISIONS),
        default=["bf16", "fp16"],
        help="comma list of bf16, fp16, fp32 (default: bf16,fp16)",
    )
    parser.add_argument(
        "--optimizers",
        type=comma_list(OPTIMIZERS),
        default=list(OPTIMIZERS),
        help="our loop's optimizers, comma list of lamb, onebit_lamb, adamw (default: all)",
    )
    parser.add_argument(
        "--impl",
        type=comma_list(IMPLS),
        default=list(IMPLS),
        help="LAMB's and 1-bit LAMB's implementations, alternated on one trainer: comma list "
        "of reference, fused, fused-separate (1-bit LAMB's fused kernels with the fold and "
        "the expansion in passes of their own; LAMB has no such row) (default: all)",
    )
    counts = {
        "--steps": (20, "timed steps per configuration (default: 20)"),
        "--warmup-steps": (
            10,
            "untimed steps before them (default: 10; >= 2: compilation, the 1-bit LAMB "
            "switch and the fp16 loss scale settle here)",
        ),
        "--batch-size": (
            64,
            "sequences per step at length 128, one micro-batch (default: 64); length 512 "
            "takes a quarter of it (the same tokens per step)",
        ),
        "--repeats": (3, "rounds of --steps timed steps per implementation (default: 3)"),
        "--vocab-size": (
            30522,
            "the model's embedding and MLM head rows, at least the tokenizer's (default: "
            "30522, BERT's uncased vocabulary, whatever the corpus's tokenizer learned)",
        ),
        "--max-documents": (3000, "Wikipedia articles to prepare (default: 3000, as bench-train)"),
        "--profile-steps": (
            0,
            "steps per implementation profiled after the timed ones, for each row's profile: "
            "the step's time by category and its largest kernels (default: 0, none)",
        ),
    }
    for flag, (default, text) in counts.items():
        parser.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument(
        "--rows-out",
        type=Path,
        default=None,
        help="also append each configuration's rows to this file as JSON lines as soon as "
        "it has run, so that an invocation stopped by a time limit keeps them",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the peak MFU divides by (default: the GPU's dense bf16/fp16 peak where known)",
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        help="memory bandwidth for the optimizer's floor, GB/s (default: measured by a copy)",
    )
    switches = {
        "--optimizer-steps": "also time LAMB's and 1-bit LAMB's steps alone on the preset",
        "--hf-baseline": "also train with HF Trainer for the ratios",
    }
    for flag, text in switches.items():
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=True, help=f"{text} (default: on)"
        )
    choices = {
        "--compile": (
            ("off", "on", "both"),
            "both",
            "eager, torch.compile, or both (default: both)",
        ),
        "--compile-mode": (
            ("default", "reduce-overhead", "max-autotune"),
            "default",
            "torch.compile's mode for our loop when compiled (model.compile; "
            "reduce-overhead adds CUDA graphs; default: default)",
        ),
        "--model": (MODELS, "bert-large", "the model preset (default: bert-large)"),
        "--packing": (
            ("off", "on", "both"),
            "off",
            "our loop with each micro-batch's sequences packed into as few rows as fit "
            "(data.packing), without, or both (default: off)",
        ),
        "--device": (
            ("cuda", "cpu"),
            "cuda",
            "cuda (default), or cpu: a dry run of the plumbing in fp32, no GPU figure",
        ),
    }
    for flag, (values, default, text) in choices.items():
        parser.add_argument(flag, choices=values, default=default, help=text)
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.steps, args.batch_size, args.max_documents, args.repeats) < 1:
        parser.error("--steps, --batch-size, --max-documents and --repeats must be >= 1")
    if args.profile_steps < 0:
        parser.error("--profile-steps must be >= 0 (0: no profile)")
    if args.rows_out is not None and not args.rows_out.parent.is_dir():
        parser.error(f"--rows-out: no folder {args.rows_out.parent} to write {args.rows_out} in")
    fused = [impl for impl in args.impl if impl != "reference"]
    if fused:
        from onebit_bert.kernels import interpreter_problem, interpreting, triton_available

        named = ",".join(fused)
        if not triton_available():
            parser.error(f"--impl {named} needs Triton (pip install '.[gpu]'); or --impl reference")
        if args.device == "cpu" and not interpreting():
            parser.error(
                f"--impl {named} on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)"
            )
        if args.device == "cpu" and interpreter_problem() is not None:
            parser.error(f"--impl {named} on the CPU: {interpreter_problem()}")
    if args.warmup_steps < 2:
        parser.error(
            "--warmup-steps must be >= 2: the first steps compile, switch 1-bit LAMB to its "
            "compression stage and settle the fp16 loss scale"
        )
    if args.device == "cpu" and args.precisions != ["fp32"]:
        parser.error("--device cpu runs in fp32 only: add --precisions fp32")
