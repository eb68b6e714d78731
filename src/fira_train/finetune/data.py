"""Fine-tuning records and batches: the union of the tasks' training sets, tokenized LLM-Adapters
style, right-padded into batches."""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fira_train.finetune.commonsense import CommonsenseDataError, format_prompt, has_split, load_split, subsample
from fira_train.finetune.config import FinetuneConfig


def load_records(config: FinetuneConfig) -> tuple[list[dict], dict[str, list[dict]], list[str]]:
    """``(train_records, test_records_by_task, trained_on)`` -- every file checked before any model loads.

    Each test record carries its ``index`` in the test file: two runs' predictions are paired on it.
    """
    tests = {spec.name: subsample([{**r, "index": i} for i, r in enumerate(load_split(config.data_dir, spec, "test"))],
                                  config.max_eval, config.seed)
             for spec in config.task_specs}
    for name, records in tests.items():  # 0 of 0 would enter the average as accuracy 0
        if not records:
            raise CommonsenseDataError(
                f"{Path(config.data_dir) / name / 'test.json'} holds no test records: add records, or leave "
                f"{name} out of --tasks (an empty test set has no accuracy to average)")
    train: list[dict] = []
    trained_on: list[str] = []
    if config.trains:
        pool, with_records = _training_pool(config)
        drawn = pool[:train_limit(config)]
        train = [record for _, _, record in drawn]
        # the tasks the drawn records come from: a short run's draw may hold none of a task's
        # (the report listed every task with a training set as trained on)
        trained_on = [task for task in with_records if any(name == task for name, _, _ in drawn)]
    return train, tests, trained_on


def load_validation(config: FinetuneConfig) -> dict[str, list[dict]]:
    """``config.max_val`` records of each trained-on task that the run does not train on: the
    training pool after the records it trains on (same seeded shuffle), so they are disjoint from
    the training records by construction and from the test sets by file. Each carries its
    ``index`` in its task's ``train.json``. A learning rate is chosen on these, never on the test
    examples. The tasks are those :func:`load_records` lists as trained on: a task whose training
    set the run's draw left out is not validated (it was, while ``trained_on`` left it out). Empty
    when the run does not train or ``max_val`` is 0."""
    if not config.trains or not config.max_val:
        return {}
    pool, with_records = _training_pool(config)
    drawn = {task for task, _, _ in pool[:train_limit(config)]}
    validation: dict[str, list[dict]] = {name: [] for name in with_records if name in drawn}
    for task, index, record in pool[train_limit(config):]:
        if task in validation and len(validation[task]) < config.max_val:
            validation[task].append({**record, "index": index})
    empty = [task for task, records in validation.items() if not records]
    if empty:
        raise CommonsenseDataError(
            f"max_val={config.max_val}: no training record of {', '.join(empty)} is left over for validation (the "
            f"run trains on all of them, or the file holds none); train on fewer records (--max-train, --steps) "
            f"or leave --max-val out")
    short = {task: len(records) for task, records in validation.items() if len(records) < config.max_val}
    if short:  # the rest of the pool: fewer than asked, said rather than left to the record counts
        warnings.warn(f"max_val={config.max_val}: only {', '.join(f'{n} records of {t}' for t, n in short.items())} "
                      "are left over for validation (the others are trained on)", UserWarning, stacklevel=2)
    return validation


def _training_pool(config: FinetuneConfig) -> tuple[list[tuple[str, int, dict]], list[str]]:
    """The union of the tasks' training sets as ``(task, index in its file, record)``, in the
    run's seeded order, and the tasks it comes from (a ``train.json`` holding no records is no
    training set: the report listed its task as trained on)."""
    pool: list[tuple[str, int, dict]] = []
    trained_on: list[str] = []
    empty: list[str] = []
    for spec in config.task_specs:
        if has_split(config.data_dir, spec, "train"):
            records = load_split(config.data_dir, spec, "train")
            pool.extend((spec.name, i, r) for i, r in enumerate(records))
            (trained_on if records else empty).append(spec.name)
    if not pool:
        held = f" ({', '.join(f'{name}/train.json' for name in empty)} hold no records)" if empty else ""
        raise CommonsenseDataError(
            f"none of the tasks {config.tasks} has a train.json with records under {config.data_dir}{held}; "
            f"add a task with a training set or run zero-shot (--method none or --steps 0)"
        )
    random.Random(config.seed).shuffle(pool)  # the permutation depends on the length alone
    return pool, trained_on


def train_limit(config: FinetuneConfig) -> int:
    """The training records a run draws: ``max_train``, else one pass of ``steps x batch_size``."""
    return config.max_train if config.max_train is not None else config.steps * config.batch_size


def tokenize_for_training(tokenizer: Any, record: dict, cutoff_len: int, train_on_inputs: bool) -> dict:
    """Token ids and labels of prompt + output + EOS, cut at ``cutoff_len`` (LLM-Adapters' ``tokenize``)."""
    full = format_prompt(record["instruction"], record.get("input", ""), record["output"])
    ids = tokenizer(full, truncation=True, max_length=cutoff_len)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and ids[-1] != eos and len(ids) < cutoff_len:
        ids = ids + [eos]
    labels = list(ids)
    if not train_on_inputs:
        prompt_len = len(tokenizer(format_prompt(record["instruction"], record.get("input", "")))["input_ids"])
        labels[:prompt_len] = [-100] * min(prompt_len, len(labels))
    return {"input_ids": ids, "labels": labels}


class PaddingCollator:
    """Right-pads a batch: ``pad_id`` in the inputs, 0 in the mask, -100 (ignored) in the labels."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n] = torch.tensor(f["input_ids"])
            mask[row, :n] = 1
            labels[row, :n] = torch.tensor(f["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
