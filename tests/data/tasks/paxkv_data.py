"""Loaders for the test tasks: the data lies beside this folder, so the task YAMLs work from
any working directory and without a download (lm-eval calls ``custom_dataset``)."""

from __future__ import annotations

import json
import os

import datasets

DATA = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(name: str) -> datasets.Dataset:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return datasets.Dataset.from_list([json.loads(line) for line in f if line.strip()])


def multiple_choice(**kwargs) -> dict[str, datasets.Dataset]:
    """16 hand-written questions (test) and 5 more for few-shot examples (train)."""
    return {"test": _jsonl("mc.jsonl"), "train": _jsonl("mc_train.jsonl")}


def rolling(**kwargs) -> dict[str, datasets.Dataset]:
    """Three hand-written paragraphs, one document each."""
    with open(os.path.join(DATA, "rolling.txt"), encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    return {"test": datasets.Dataset.from_list([{"text": p} for p in paragraphs])}


def generation(**kwargs) -> dict[str, datasets.Dataset]:
    """Four short questions for greedy generation."""
    return {"test": _jsonl("gen.jsonl")}
