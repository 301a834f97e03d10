"""Spec-Bench prompts (jsonl files with a ``turns`` or ``prompt`` field), for the tests and
the benchmarks."""

from __future__ import annotations

import json
import os
from pathlib import Path

SPECBENCH_ENV = "DUO_SPECBENCH_DIR"
TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")


def specbench_dir() -> Path:
    """``$DUO_SPECBENCH_DIR``, else ``../shared/data/specbench`` beside the repository."""
    if os.environ.get(SPECBENCH_ENV):
        return Path(os.environ[SPECBENCH_ENV])
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "specbench"


def read_jsonl(path: str | Path) -> list[str]:
    """First user turn of each record (``turns[0]``, or ``prompt``)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [rec["turns"][0] if "turns" in rec else rec["prompt"] for rec in records]


def load_specbench(per_task: int, tasks=TASKS,
                   root: str | Path | None = None) -> list[tuple[str, str]]:
    """``(task, prompt)`` pairs: the first ``per_task`` prompts of each task."""
    root = Path(root) if root else specbench_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"Spec-Bench prompts not found at {root}; set "
                                f"${SPECBENCH_ENV} to the folder holding translation.jsonl, ...")
    return [(task, p) for task in tasks for p in read_jsonl(root / f"{task}.jsonl")[:per_task]]


def chat_prompts(tokenizer, prompts: list[str]) -> list[str]:
    """Apply the target's chat template to single-turn user prompts."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]
