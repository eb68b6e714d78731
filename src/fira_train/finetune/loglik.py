r"""Log-likelihood scoring of the commonsense tasks with lm-eval (EleutherAI's lm-evaluation-harness).

Every test record becomes the (context, continuation) pairs of
:func:`~fira_train.finetune.choices.multiple_choice`, posed to lm-eval as a ``multiple_choice``
task defined here (the records in memory, no download); lm-eval's ``HFLM`` scores the pairs on the
model in memory (the one just trained, LoRA adapters included, in eval mode, under ``no_grad``)
and its task code turns the scores into per-example accuracies. For option i of an example,

.. math::

    \ell_i = \sum_{t=1}^{|c_i|} \log p(c_{i,t} \mid x_i, c_{i,<t}),
    \qquad \mathrm{acc} = [\arg\max_i \ell_i = \mathrm{gold}],
    \qquad \mathrm{acc\_norm} = [\arg\max_i \ell_i / \mathrm{len}(c_i) = \mathrm{gold}],

with :math:`x_i` the context tokens, :math:`c_i` the continuation tokens (natural log, ties to the
first option) and :math:`\mathrm{len}(c_i)` the option's length in characters without the space
before it, as lm-eval's own tasks (ARC, PIQA, HellaSwag) count it: the space is their
``target_delimiter``, and so it is here. lm-eval tokenises context + continuation as one string
and takes as the continuation the tokens after the context's own tokens (trailing spaces of the
context move to the continuation, so the space is scored with the option). Runs made before
2026-11-29 (their ``results.json`` records no ``code``) divided by the length with the space:
their ``acc_norm`` differs, their log-likelihoods and ``acc`` do not. WinoGrande's options share their continuation, so its ``acc_norm`` equals its
``acc`` (lm-eval's own ``winogrande`` reports ``acc`` only; asked for ``acc_norm`` with several
contexts it would divide by the contexts' lengths, which is not the definition above), and it is
recorded as such.

lm-eval is an optional dependency (the ``train`` extra installs it): :func:`require_lm_eval` says
how to install it, or to score with ``--scoring generate``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from fira_train.finetune.choices import MultipleChoice, multiple_choice
from fira_train.finetune.commonsense import TaskSpec
from fira_train.finetune.config import FinetuneError, non_finite_scores

__all__ = ["require_lm_eval", "questions_of", "LoglikScorer"]

#: The versions this module was written against (``lm_eval.simple_evaluate``, ``HFLM``, task configs as dicts).
LM_EVAL_REQUIREMENT = "lm-eval>=0.4.13,<0.5"


def require_lm_eval() -> None:
    """Raise :class:`~fira_train.finetune.config.FinetuneError` when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise FinetuneError(f"scoring='loglik' scores with lm-eval, which is not installed: "
                            f"pip install '{LM_EVAL_REQUIREMENT}' (or score with --scoring generate)")


def questions_of(task: TaskSpec, records: Sequence[dict[str, Any]]) -> list[MultipleChoice]:
    """Every record of ``task`` as a :class:`~fira_train.finetune.choices.MultipleChoice` (errors name the record)."""
    return [multiple_choice(task, record) for record in records]


def _task_config(task: TaskSpec, questions: Sequence[MultipleChoice]) -> dict[str, Any]:
    """An lm-eval ``multiple_choice`` task over ``questions``, posed as lm-eval's own tasks are:
    the space before each continuation is the ``target_delimiter``, not part of the option, so that
    ``acc_norm`` divides by the option's own characters (the scored text is the same)."""
    import datasets

    def option(continuation: str) -> str:
        if not continuation.startswith(" "):
            raise ValueError(f"continuation {continuation!r:.80} does not start with the space before an answer")
        return continuation[1:]

    docs = [{"contexts": list(q.contexts), "continuations": [option(c) for c in q.continuations], "gold": q.gold}
            for q in questions]
    partial = bool(questions) and questions[0].partial
    config: dict[str, Any] = {
        "task": f"fira_train_{task.name}",
        "custom_dataset": lambda **_: {"test": datasets.Dataset.from_list(docs)},
        "test_split": "test",
        "output_type": "multiple_choice",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
        + ([] if partial else [{"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]),
    }
    if partial:  # lm-eval's multiple-input form: doc_to_text gives the gold index, the choices are the contexts
        config |= {"doc_to_text": lambda d: d["gold"], "doc_to_choice": lambda d: d["contexts"],
                   "doc_to_target": lambda d: d["continuations"][0]}
    else:
        config |= {"doc_to_text": lambda d: d["contexts"][0], "doc_to_choice": lambda d: d["continuations"],
                   "doc_to_target": lambda d: d["gold"]}
    return config


class LoglikScorer:
    """lm-eval's ``HFLM`` around ``model`` and its task index, built once for every task of a run."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 16):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be positive")
        require_lm_eval()
        from lm_eval.models.huggingface import HFLM

        self.model = model
        self._was_training = model.training
        with _quiet():
            self.lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)  # sets model.eval()
            self.task_manager = _task_manager()

    def close(self) -> None:
        """Give the model back in the mode it was in."""
        self.model.train(self._was_training)

    def evaluate_task(self, task: TaskSpec, records: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[dict]]:
        """``(metrics, predictions)`` on ``records`` of ``task``.

        ``metrics``: ``accuracy``, ``correct``, ``accuracy_norm``, ``correct_norm``, ``n``,
        ``seconds``; ``predictions``, per record in order: its ``index``, the option
        log-likelihoods ``logliks``, the ``prediction`` (label of the largest), the ``answer``,
        ``correct`` and ``correct_norm`` (lm-eval's per-example ``acc`` and ``acc_norm``).
        """
        import lm_eval

        started = time.perf_counter()
        questions = questions_of(task, records)
        config = _task_config(task, questions)
        with _quiet():
            out = lm_eval.simple_evaluate(
                model=self.lm, tasks=[config], task_manager=self.task_manager, log_samples=True,
                bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                fewshot_random_seed=None,
            )
        samples = sorted(out["samples"][config["task"]], key=lambda s: s["doc_id"])
        if [s["doc_id"] for s in samples] != list(range(len(questions))):
            raise RuntimeError(f"lm-eval returned samples {[s['doc_id'] for s in samples][:10]}... for "
                               f"{len(questions)} {task.name} examples")
        predictions = []
        for record, question, sample in zip(records, questions, samples):
            logliks = [float(ll) for ll, _ in sample["filtered_resps"]]
            best = max(range(len(logliks)), key=lambda i: (logliks[i], -i))  # first of the largest
            correct = bool(sample["acc"])
            predictions.append({
                "index": record.get("index"), "logliks": logliks, "prediction": question.labels[best],
                "answer": record["answer"], "correct": correct,
                "correct_norm": bool(sample["acc_norm"]) if "acc_norm" in sample else correct,
            })
        broken = [p["index"] for p in predictions if not all(math.isfinite(x) for x in p["logliks"])]
        if broken:  # the argmax of NaNs is no prediction: an accuracy from them would be noise
            raise non_finite_scores(task.name, "the model's log-likelihood of an answer is", len(broken),
                                    len(predictions), broken[0])
        n = len(predictions)
        correct = sum(p["correct"] for p in predictions)
        correct_norm = sum(p["correct_norm"] for p in predictions)
        metrics = {"accuracy": correct / n if n else 0.0, "correct": correct,
                   "accuracy_norm": correct_norm / n if n else 0.0, "correct_norm": correct_norm, "n": n,
                   "seconds": time.perf_counter() - started}
        return metrics, predictions


@functools.lru_cache(maxsize=1)
def _task_manager() -> Any:
    """lm-eval's index of its own task files (seconds to build; lm-eval wants one even for tasks given as dicts)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


class _quiet:
    """lm-eval's info and warning lines (one per task and call) off while it runs; errors still show.

    Its results' provenance fields, which nothing here reads, are not collected either: each call
    ran ``git describe`` (outside a git checkout git printed "fatal: not a git repository" on
    stderr, once per task) and torch's ``collect_env`` (0.5-1.5 s of subprocesses per call on
    this machine)."""

    def __enter__(self) -> None:
        import lm_eval.evaluator as evaluator

        self.logger = logging.getLogger("lm_eval")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)
        self.evaluator = evaluator
        self.saved = {name: getattr(evaluator, name, None) for name in ("get_git_commit_hash", "add_env_info")}
        if self.saved["get_git_commit_hash"] is not None:
            evaluator.get_git_commit_hash = lambda: None
        if self.saved["add_env_info"] is not None:
            evaluator.add_env_info = lambda storage: None

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)
        for name, value in self.saved.items():
            if value is not None:
                setattr(self.evaluator, name, value)
