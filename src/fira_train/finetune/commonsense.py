r"""The commonsense-reasoning benchmark of LLM-Adapters (Hu et al., 2023), as the Fira paper uses it.

Eight tasks, each a folder ``<data_dir>/<task>/`` holding ``train.json`` and/or ``test.json``:
a JSON list of records ``{"instruction", "input", "output", "answer"}`` where ``output`` is the
target text (``"the correct answer is answer3"``) and ``answer`` the label (``"answer3"``).

Protocol (LLM-Adapters ``finetune.py`` / ``commonsense_evaluate.py``):

* training text = :func:`format_prompt` (instruction, input, output) + EOS, the loss on every
  token (``train_on_inputs=True``), cut at 256 tokens; the training set is the union of the tasks'
  training sets;
* evaluation (``--scoring generate``): generate from the prompt without the output, then take the
  *first* occurrence of one of the task's label strings in the generated text (``""`` when none
  occurs); an example is correct iff that string equals ``answer``; accuracy = correct /
  examples, per task, and the benchmark number is the plain mean of the per-task accuracies.
  The released regular expression is case-sensitive; here it is not (``"True"`` counts as
  ``"true"``), so a model that learned the answer but not its capitalisation is not scored wrong.

The default scoring is by log-likelihood of each option instead (:mod:`.choices`, :mod:`.loglik`).

The released template is an indented triple-quoted string (its indentation ends up in the
prompt, and the training and evaluation templates differ by a trailing space); this module uses
the same words without the stray indentation, identically for training and evaluation.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fira_train.files import parse_json

__all__ = [
    "TASKS",
    "CommonsenseDataError",
    "TaskSpec",
    "resolve_task",
    "parse_tasks",
    "format_prompt",
    "extract_answer",
    "score",
    "load_split",
    "has_split",
    "subsample",
    "default_data_dir",
]


class CommonsenseDataError(ValueError):
    """A data folder, task file or record that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class TaskSpec:
    """One task: its folder name and the label strings its answers are drawn from."""

    name: str
    labels: tuple[str, ...]
    description: str

    @property
    def pattern(self) -> re.Pattern[str]:
        # Alternation in the released order, case-insensitive; labels are plain words, escaping is harmless.
        return re.compile("|".join(re.escape(label) for label in self.labels), re.IGNORECASE)


def _numbered(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


#: Folder name -> task. The multiple-choice tasks all accept answer1..answer5 as released
#: (ARC-Easy has a handful of five-choice questions).
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("boolq", ("true", "false"), "BoolQ: yes/no questions"),
        TaskSpec("piqa", _numbered("solution", 2), "PIQA: physical commonsense, two solutions"),
        TaskSpec("social_i_qa", _numbered("answer", 5), "SIQA: social commonsense, three answers"),
        TaskSpec("hellaswag", _numbered("ending", 4), "HellaSwag: sentence endings, four choices"),
        TaskSpec("winogrande", _numbered("option", 2), "WinoGrande: fill in the blank, two options"),
        TaskSpec("ARC-Easy", _numbered("answer", 5), "ARC-Easy: grade-school science"),
        TaskSpec("ARC-Challenge", _numbered("answer", 5), "ARC-Challenge: hard grade-school science"),
        TaskSpec("openbookqa", _numbered("answer", 5), "OpenBookQA: science facts, four answers"),
    )
}

_ALIASES: dict[str, str] = {
    "siqa": "social_i_qa",
    "social-i-qa": "social_i_qa",
    "arc-e": "ARC-Easy",
    "arc_e": "ARC-Easy",
    "arc-c": "ARC-Challenge",
    "arc_c": "ARC-Challenge",
    "obqa": "openbookqa",
    **{name.lower(): name for name in TASKS},
}


def resolve_task(name: str) -> TaskSpec:
    """The task called ``name`` (folder name, case-insensitive, or an alias such as ``siqa``)."""
    key = name.strip()
    canonical = key if key in TASKS else _ALIASES.get(key.lower())
    if canonical is None:
        known = ", ".join(TASKS)
        raise CommonsenseDataError(f"unknown task {name!r}; known tasks: {known} (aliases: siqa, arc-e, arc-c, obqa)")
    return TASKS[canonical]


def parse_tasks(value: str | Sequence[str]) -> list[TaskSpec]:
    """Tasks from a comma-separated string (``"boolq,piqa"``) or a list; duplicates dropped, order kept."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n for n in (n.strip() for n in names) if n]
    if not names:
        raise CommonsenseDataError(f"tasks={value!r} names no task")
    specs: list[TaskSpec] = []
    for name in names:
        spec = resolve_task(name)
        if spec not in specs:
            specs.append(spec)
    return specs


_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_prompt(instruction: str, input: str = "", output: str = "") -> str:
    """The Alpaca / LLM-Adapters prompt; with ``output=""`` it is the generation prompt.

    The training text is ``format_prompt(instruction, input, output)`` (then EOS); the
    evaluation prompt is its prefix ``format_prompt(instruction, input)``, so a model that
    learned the training texts continues the evaluation prompt with the answer sentence.
    """
    template = _PROMPT_WITH_INPUT if input else _PROMPT_NO_INPUT
    return template.format(instruction=instruction, input=input) + output


def extract_answer(task: str | TaskSpec, generated: str) -> str:
    """The first label string of ``task`` that occurs in ``generated``, or ``""`` if none does.

    Case-insensitive, returned in the label's own spelling: ``"True"`` gives ``"true"`` and
    ``"Answer3"`` gives ``"answer3"`` (the released extraction is case-sensitive and scores both
    wrong). For boolq ``"the correct answer is false"`` gives ``"false"``; for piqa the first of
    ``solution1|solution2`` wins, so ``"solution2, not solution1"`` gives ``"solution2"``.
    """
    spec = task if isinstance(task, TaskSpec) else resolve_task(task)
    match = spec.pattern.search(generated.strip())
    if not match:
        return ""
    found = match.group(0).lower()
    return next(label for label in spec.labels if label.lower() == found)


def score(task: str | TaskSpec, generations: Sequence[str], answers: Sequence[str]) -> dict[str, float | int]:
    """Accuracy of ``generations`` against the gold ``answers`` under :func:`extract_answer`.

    Returns ``{"accuracy", "correct", "n", "unparsed"}`` where ``unparsed`` counts generations in
    which no label string occurs (they count as wrong: a diagnostic of the answer format, which a
    model that was not fine-tuned often misses).
    """
    if len(generations) != len(answers):
        raise ValueError(f"generations ({len(generations)}) and answers ({len(answers)}) differ in length")
    predictions = [extract_answer(task, text) for text in generations]
    correct = sum(int(p == a) for p, a in zip(predictions, answers))
    n = len(answers)
    return {
        "accuracy": correct / n if n else 0.0,
        "correct": correct,
        "n": n,
        "unparsed": sum(int(p == "") for p in predictions),
    }


_RECORD_KEYS = ("instruction", "output", "answer")


def default_data_dir() -> Path:
    """``<project root>/../shared/data/commonsense``: where the machines this project is developed
    on keep the LLM-Adapters data (the tests that need it are skipped where it is absent). From a
    checkout nested deeper (a git worktree inside the project folder) the first such folder
    found in an ancestor is used."""
    root = Path(__file__).resolve().parents[3]
    candidates = [folder / "shared" / "data" / "commonsense" for folder in root.parents]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def _task_dir(data_dir: str | Path, spec: TaskSpec) -> Path:
    root = Path(data_dir)
    if not root.is_dir():
        raise CommonsenseDataError(
            f"data_dir={str(data_dir)!r} is not a directory; it must hold one folder per task "
            f"(e.g. boolq/test.json) in the LLM-Adapters format (github.com/AGI-Edgerunners/LLM-Adapters, dataset/)"
        )
    return root / spec.name


def has_split(data_dir: str | Path, task: str | TaskSpec, split: str) -> bool:
    """Whether ``<data_dir>/<task>/<split>.json`` exists."""
    spec = task if isinstance(task, TaskSpec) else resolve_task(task)
    return (_task_dir(data_dir, spec) / f"{split}.json").is_file()


def load_split(data_dir: str | Path, task: str | TaskSpec, split: str) -> list[dict[str, str]]:
    """The records of ``<data_dir>/<task>/<split>.json``, validated.

    Raises :class:`CommonsenseDataError` naming the file when it is missing, is not UTF-8, is not a JSON list,
    or holds a record without ``instruction``/``output``/``answer`` or with an answer that is not
    one of the task's labels.
    """
    if split not in ("train", "test"):
        raise CommonsenseDataError(f"split={split!r} must be 'train' or 'test'")
    spec = task if isinstance(task, TaskSpec) else resolve_task(task)
    path = _task_dir(data_dir, spec) / f"{split}.json"
    if not path.is_file():
        present = sorted(p.stem for p in path.parent.glob("*.json")) if path.parent.is_dir() else []
        found = f"the folder holds {present}" if present else f"{path.parent} does not exist or holds no .json"
        root = Path(data_dir)
        if (root / f"{split}.json").is_file():  # --data-dir named a task's folder, not the one above them
            found += (f"; {root} itself holds {split}.json: data_dir is the folder that holds one folder per task, "
                      f"here perhaps {str(root.resolve().parent)!r}")
        raise CommonsenseDataError(f"task {spec.name!r} has no {split} file: {path} is missing ({found})")
    try:
        records = parse_json(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        if not err.doc.strip():  # json's "Expecting value: line 1 column 1 (char 0)" did not say it
            raise CommonsenseDataError(f"{path} is empty: it must hold a JSON list of records ([] for none)") from None
        # a JSON Lines file (one record per line, as many datasets ship) stops after its first record
        lines = (" (it holds one JSON value after another, as JSON Lines does: the LLM-Adapters format is one "
                 "JSON list of records, [{...}, {...}])" if err.msg == "Extra data" else "")
        raise CommonsenseDataError(f"{path} is not valid JSON: {err}{lines}") from None
    except UnicodeDecodeError as err:
        raise CommonsenseDataError(
            f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8 OLD > {path.name}"
        ) from None
    if not isinstance(records, list):
        raise CommonsenseDataError(f"{path} must hold a JSON list of records, found {type(records).__name__}")
    for index, record in enumerate(records):
        if not isinstance(record, dict) or any(not isinstance(record.get(k), str) for k in _RECORD_KEYS):
            raise CommonsenseDataError(
                f"{path} record {index} must be an object with string fields {list(_RECORD_KEYS)}: {record!r:.200}"
            )
        if record["answer"] not in spec.labels:
            raise CommonsenseDataError(
                f"{path} record {index} has answer={record['answer']!r}, not one of {list(spec.labels)}"
            )
    return [
        {
            "instruction": r["instruction"],
            "input": r.get("input") or "",
            "output": r["output"],
            "answer": r["answer"],
        }
        for r in records
    ]


def subsample(records: Sequence[dict], limit: int | None, seed: int = 0) -> list[dict]:
    """A seeded random subset of ``limit`` records in their original order (all when ``limit`` is None)."""
    if limit is None or limit >= len(records):
        return list(records)
    if limit < 0:
        raise ValueError(f"limit={limit} must be >= 0 or None")
    keep = sorted(random.Random(seed).sample(range(len(records)), limit))
    return [records[i] for i in keep]
