"""fira_train.finetune.loglik: lm-eval's option log-likelihoods against a float64 reference of the same definition.

The reference (:func:`reference_logliks`) is written here from the definition in the module
docstring: continuation tokens = tokens(context + continuation) after the context's own tokens,
log-likelihood = the sum of their log-probabilities under one forward pass. The lm-eval tests
skip where lm-eval is not installed (the ``train`` extra installs it).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from fira_train.finetune import loglik  # noqa: E402
from fira_train.finetune.choices import multiple_choice  # noqa: E402
from fira_train.finetune.commonsense import resolve_task  # noqa: E402
from fira_train.finetune.config import FinetuneError  # noqa: E402
from tests.fira_train.finetune.test_run import build_tokenizer  # noqa: E402

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")

WORDS = "sun snow fire ice water stone tree river cloud sand warm cold bright dark heavy light".split()


def arc_record(rng: random.Random, index: int) -> dict:
    options = [" ".join(rng.sample(WORDS, rng.randint(1, 4))) for _ in range(rng.choice([3, 4]))]
    answer = f"answer{rng.randint(1, len(options))}"
    marks = " ".join(f"Answer{i}: {o}" for i, o in enumerate(options, 1))
    fmt = "/".join(f"answer{i}" for i in range(1, len(options) + 1))
    question = " ".join(rng.sample(WORDS, 5)) + "?"
    return {"instruction": f"Please choose the correct answer to the question: {question}\n\n{marks}\n\n"
                           f"Answer format: {fmt}", "input": "", "output": f"the correct answer is {answer}",
            "answer": answer, "index": index}


def wino_record(rng: random.Random, index: int) -> dict:
    a, b = rng.sample(WORDS, 2)
    sentence = f"the {rng.choice(WORDS)} is _ and {' '.join(rng.sample(WORDS, rng.randint(1, 3)))} today ."
    answer = rng.choice(["option1", "option2"])
    return {"instruction": f"Please choose the correct answer to fill in the blank to complete the given sentence: "
                           f"{sentence}\n\nOption1: {a} Option2: {b} Answer format: option1/option2", "input": "",
            "output": f"the correct answer is {answer}", "answer": answer, "index": index}


@pytest.fixture(scope="module")
def tiny64():
    """A tiny random LLaMA in float64 and a word-level tokenizer that knows every word of the records."""
    texts = [" ".join(WORDS) + " Question : Answer ? . the is and today Q A"]
    tokenizer = build_tokenizer(texts)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).double()
    with torch.no_grad():  # larger logits than the default init, so options differ clearly
        for p in model.parameters():
            p.mul_(4.0)
    return model, tokenizer


@torch.no_grad()
def reference_logliks(model, tokenizer, requests: list[tuple[str, str]]) -> list[float]:
    """Sum of log p(continuation token | everything before it), float64, one sequence at a time."""
    out = []
    for context, continuation in requests:
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        n_context = len(tokenizer.encode(context, add_special_tokens=False))
        assert 0 < n_context < len(whole)
        logits = model(torch.tensor([whole[:-1]])).logits[0].to(torch.float64)
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(sum(float(logprobs[t - 1, whole[t]]) for t in range(n_context, len(whole))))
    return out


def first_argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


@needs_lm_eval
@pytest.mark.parametrize("task, make", [("ARC-Easy", arc_record), ("winogrande", wino_record)])
def test_lm_eval_logliks_and_accuracies_match_the_float64_reference(tiny64, task, make):
    model, tokenizer = tiny64
    rng = random.Random(5)  # ARC: a record whose acc_norm the two length rules (with the space or not) decide apart
    records = [make(rng, i) for i in range(12)]
    spec = resolve_task(task)
    model.train()
    before = [p.clone() for p in model.parameters()]
    scorer = loglik.LoglikScorer(model, tokenizer, batch_size=5)
    metrics, predictions = scorer.evaluate_task(spec, records)
    scorer.close()
    assert model.training  # given back in its mode
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # scoring changes no weight
    model.eval()
    correct = correct_norm = told_apart = 0
    for record, prediction in zip(records, predictions):
        question = multiple_choice(spec, record)
        reference = reference_logliks(model, tokenizer, question.requests)
        assert prediction["logliks"] == pytest.approx(reference, rel=1e-9, abs=1e-9)
        lengths = [len(c) - 1 for _, c in question.requests]  # the option without the space before it
        best, best_norm = first_argmax(reference), first_argmax([ll / n for ll, n in zip(reference, lengths)])
        assert prediction["correct"] == (best == question.gold)
        assert prediction["correct_norm"] == (best_norm == question.gold)
        assert prediction["prediction"] == question.labels[best] and prediction["index"] == record["index"]
        correct += best == question.gold
        correct_norm += best_norm == question.gold
        # dividing by the length with the space before the option (the rule before lm-eval's tasks' own)
        with_space = first_argmax([ll / (n + 1) for ll, n in zip(reference, lengths)])
        told_apart += (best_norm == question.gold) != (with_space == question.gold)
    assert metrics["n"] == 12 and metrics["correct"] == correct and metrics["correct_norm"] == correct_norm
    assert metrics["accuracy"] == correct / 12 and metrics["accuracy_norm"] == correct_norm / 12
    if task == "winogrande":  # one shared continuation: dividing by its length changes no argmax
        assert metrics["correct_norm"] == metrics["correct"]
    else:  # the case is not degenerate: the two rules disagree somewhere, and not every answer is right
        assert any(p["correct"] != p["correct_norm"] for p in predictions) and 0 < correct < 12
        assert told_apart > 0  # nor is the length the norm divides by


@needs_lm_eval
def test_batch_size_does_not_change_the_scores(tiny64):
    model, tokenizer = tiny64
    rng = random.Random(2)
    records = [arc_record(rng, i) for i in range(7)]
    spec = resolve_task("ARC-Challenge")
    results = []
    for batch_size in (1, 16):
        scorer = loglik.LoglikScorer(model, tokenizer, batch_size=batch_size)
        results.append(scorer.evaluate_task(spec, records)[1])
        scorer.close()
    for a, b in zip(*results):
        assert a["logliks"] == pytest.approx(b["logliks"], rel=1e-9, abs=1e-9)


@needs_lm_eval
def test_scoring_outside_a_git_checkout_prints_nothing_of_git(tiny64, tmp_path, monkeypatch, capfd):
    """lm-eval ran `git describe` per call for a field nothing reads: "fatal: not a git repository"."""
    import lm_eval.evaluator

    model, tokenizer = tiny64
    monkeypatch.chdir(tmp_path)
    before = lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info
    scorer = loglik.LoglikScorer(model, tokenizer, batch_size=4)
    scorer.evaluate_task(resolve_task("ARC-Challenge"), [arc_record(random.Random(3), i) for i in range(2)])
    scorer.close()
    assert "fatal" not in capfd.readouterr().err
    assert (lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info) == before  # restored


def test_a_missing_lm_eval_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(loglik.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FinetuneError, match=r"lm-eval, which is not installed: pip install 'lm-eval.*--scoring gen"):
        loglik.require_lm_eval()


@needs_lm_eval
def test_non_finite_logliks_are_an_error_not_an_accuracy(tiny64):
    """A model whose weights are not finite (or whose fp16 activations overflowed) gave NaN
    log-likelihoods, whose argmax was reported as its predictions and accuracy."""
    import copy

    model, tokenizer = tiny64
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.lm_head.weight[3].fill_(float("nan"))
    records = [arc_record(random.Random(4), i) for i in range(3)]
    scorer = loglik.LoglikScorer(broken, tokenizer, batch_size=4)
    with pytest.raises(FinetuneError, match=r"ARC-Easy: the model's log-likelihood of an answer is not finite for "
                                            r"3 of 3 examples \(the first: index 0\).*no accuracy is reported"):
        scorer.evaluate_task(resolve_task("ARC-Easy"), records)
    scorer.close()
