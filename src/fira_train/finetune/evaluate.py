"""Generation-based evaluation of a causal LM on the commonsense tasks (the LLM-Adapters protocol,
``--scoring generate``; the default, log-likelihood scoring, is :mod:`fira_train.finetune.loglik`).

For each test record: prompt = :func:`~fira_train.finetune.commonsense.format_prompt`
(instruction, input), greedy decoding of at most ``max_new_tokens`` tokens (stopping at EOS), the
new tokens decoded without special tokens, then
:func:`~fira_train.finetune.commonsense.extract_answer`. LLM-Adapters used beam search (4 beams,
max 32 new tokens); greedy decoding is the single-path equivalent and what this harness reports.
A model whose next-token scores are not finite (weights gone NaN, fp16 activations that overflowed)
is refused, as log-likelihood scoring refuses non-finite log-likelihoods: the argmax of NaNs is no
answer.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from fira_train.finetune.commonsense import TaskSpec, extract_answer, format_prompt, score
from fira_train.finetune.config import non_finite_scores

__all__ = ["generate", "evaluate_task"]


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 16,
) -> list[str]:
    """Greedy continuations of ``prompts`` (new text only), batched with left padding.

    Prompts are batched by length (fewer pad tokens) and the results returned in input order.
    ValueError if the model's next-token scores of a prompt are not finite.
    """
    outputs, broken = _generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    if broken:
        raise ValueError(f"the model's next-token scores are not finite for {len(broken)} of {len(prompts)} prompts "
                         f"(the first: prompt {broken[0]})")
    return outputs


class _NonFiniteRows(LogitsProcessor):
    """Marks the rows whose scores hold a NaN or +inf, or only -inf, at any step; changes nothing."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.broken = torch.zeros(rows, dtype=torch.bool, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # max propagates NaN; -inf alone (suppressed tokens) is fine while one score is finite
        self.broken |= ~torch.isfinite(scores.max(dim=-1).values)
        return scores


@torch.no_grad()
def _generate(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
              batch_size: int) -> tuple[list[str], list[int]]:
    """:func:`generate`'s continuations and the positions (ascending) of the prompts whose scores
    were not finite."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be positive")
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    outputs: list[str] = [""] * len(prompts)
    broken: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            width = max(len(encoded[i]) for i in index)
            ids = torch.full((len(index), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(index), width), dtype=torch.long)
            for row, i in enumerate(index):  # left padding: generation continues at the right edge
                ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
                mask[row, width - len(encoded[i]) :] = 1
            check = _NonFiniteRows(len(index), device)
            generated = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
                logits_processor=LogitsProcessorList([check]),
            )
            broken.extend(index[row] for row in check.broken.nonzero().flatten().tolist())
            new_tokens = generated[:, width:].cpu()
            for row, i in enumerate(index):
                outputs[i] = tokenizer.decode(new_tokens[row], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return outputs, sorted(broken)


def evaluate_task(
    model: torch.nn.Module,
    tokenizer: Any,
    task: TaskSpec,
    records: Sequence[dict[str, str]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 16,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(metrics, predictions)`` of ``model`` on ``records`` of ``task``.

    ``metrics`` = :func:`~fira_train.finetune.commonsense.score` plus ``seconds``; ``predictions`` holds,
    per record, its ``index`` (when the record has one), the generated text, the extracted answer, the
    gold answer and whether they agree (``correct``). :class:`~fira_train.finetune.config.FinetuneError`
    if the model's next-token scores are not finite for a record.
    """
    started = time.perf_counter()
    prompts = [format_prompt(r["instruction"], r.get("input", "")) for r in records]
    generations, broken = _generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    if broken:  # the argmax of NaNs is no answer: an accuracy from its text would be noise
        raise non_finite_scores(task.name, "the model's next-token scores are", len(broken), len(records),
                                records[broken[0]].get("index", broken[0]))
    answers = [r["answer"] for r in records]
    metrics: dict[str, Any] = dict(score(task, generations, answers))
    metrics["seconds"] = time.perf_counter() - started
    predictions = []
    for record, generation in zip(records, generations):
        prediction = extract_answer(task, generation)
        predictions.append({"index": record.get("index"), "generation": generation, "prediction": prediction,
                            "answer": record["answer"], "correct": prediction == record["answer"]})
    return metrics, predictions
