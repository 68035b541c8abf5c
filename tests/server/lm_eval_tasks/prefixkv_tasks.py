"""Datasets of the lm-evaluation-harness tasks in this folder, read from the JSONL files next to
it (no hub): each task's YAML names a loader here with `custom_dataset: !function`."""

from __future__ import annotations

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _split(name: str) -> datasets.Dataset:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return datasets.Dataset.from_list([json.loads(line) for line in f if line.strip()])


def load_mc(**_: object) -> datasets.DatasetDict:
    return datasets.DatasetDict({"train": _split("mc_train.jsonl"), "test": _split("mc_test.jsonl")})


def load_qa(**_: object) -> datasets.DatasetDict:
    return datasets.DatasetDict({"train": _split("qa_train.jsonl"), "test": _split("qa_test.jsonl")})
