"""``python -m smoke_data --out DIR``: write the smoke corpus and tasks, print a summary."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from smoke_data.documents import write_corpus
from smoke_data.tasks import TASK_SIZES, write_tasks


def _count_rows(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n") - 1


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m smoke_data",
        description="Write the offline smoke corpus (corpus.jsonl) and generated fine-tuning "
        "tasks (SST-2, MRPC, STS-B TSVs in GLUE's layout, squad/dev-v1.1.json) into one folder.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    args = parser.parse_args(argv)

    corpus = write_corpus(args.out)
    write_tasks(args.out, seed=args.seed)
    counts = json.loads((args.out / "corpus.json").read_text(encoding="utf-8"))
    squad = json.loads((args.out / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))
    summary = {
        "out": str(args.out),
        "corpus": str(corpus),
        "documents": counts["documents"],
        "characters": counts["characters"],
        "tasks": {
            task: {
                split: _count_rows(args.out / task / f"{split}.tsv") for split in ("train", "dev")
            }
            for task in TASK_SIZES
        },
        "squad": {
            "articles": len(squad["data"]),
            "paragraphs": sum(len(a["paragraphs"]) for a in squad["data"]),
            "questions": sum(len(p["qas"]) for a in squad["data"] for p in a["paragraphs"]),
        },
        "seed": args.seed,
        "python_version": counts["python_version"],
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
