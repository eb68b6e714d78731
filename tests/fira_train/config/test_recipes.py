"""Recipes: the paper's Appendix B table, and the CPU recipes' ratios."""

from __future__ import annotations

import pytest
import torch

from fira_train.config.recipes import RECIPES, get_recipe
from fira_train.methods.model import build_model, count_parameters

# Appendix B: hidden, intermediate, heads, layers, steps; Section 4.1 / Table 2: rank.
PAPER = {
    "60m": (512, 1376, 8, 8, 10_000, 128, 0.25),
    "130m": (768, 2048, 12, 12, 20_000, 256, 0.25),
    "350m": (1024, 2736, 16, 24, 60_000, 256, 0.25),
    "1b": (2048, 5461, 32, 24, 100_000, 512, 0.0625),
    "7b": (4096, 11008, 32, 32, 150_000, 64, 0.0625),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipes_follow_appendix_b(name: str) -> None:
    hidden, intermediate, heads, layers, steps, rank, alpha = PAPER[name]
    config = get_recipe(name)
    assert (config.model.hidden_size, config.model.intermediate_size, config.model.num_attention_heads,
            config.model.num_hidden_layers) == (hidden, intermediate, heads, layers)
    assert config.train.steps == steps
    assert config.optim.rank == rank
    assert config.optim.alpha == alpha
    assert config.optim.update_proj_gap == 200
    assert config.data.seq_len == 256
    assert config.train.batch_size * config.data.seq_len == 131_072  # "131K tokens per batch"
    assert config.train.warmup_fraction == 0.1 and config.train.min_lr_ratio == 0.1
    assert config.optim.method == "fira" and config.optim.lr is None  # method default: 0.01 for Fira


def test_paper_token_budgets() -> None:
    # Appendix B's data amounts: 1.3B, 2.6B, 7.8B, 13.1B, 19.7B tokens
    budgets = {n: get_recipe(n).train.steps * 131_072 / 1e9 for n in PAPER}
    assert budgets == pytest.approx({"60m": 1.31, "130m": 2.62, "350m": 7.86, "1b": 13.1, "7b": 19.66}, rel=0.01)


def test_1b_size_matches_the_papers_memory_estimate() -> None:
    # 10.40G for full-rank 1B = (params + grads + 2 Adam states) * 2 bytes -> ~1.3B parameters
    config = get_recipe("1b")
    with torch.device("meta"):
        model = build_model(config.model, vocab_size=32000, max_seq_len=256, seed=0)
    assert 1.30e9 < count_parameters(model) < 1.40e9


def test_tiny_keeps_the_papers_ratios() -> None:
    config = get_recipe("tiny")
    assert config.model.hidden_size == 256
    # the paper's main r / d_model (60M: 128 / 512), kept by both CPU recipes
    paper = get_recipe("60m")
    for recipe in (config, get_recipe("micro")):
        assert recipe.optim.rank / recipe.model.hidden_size == paper.optim.rank / paper.model.hidden_size == 1 / 4
    assert config.optim.update_proj_gap == max(1, config.train.steps // 50)  # ~50 refreshes per run
    assert config.data.vocab_size == 8192 and config.data.tokenizer == "bpe"
    assert config.data.source == "wiki"
    assert config.train.warmup_fraction == 0.1 and config.train.min_lr_ratio == 0.1


def test_micro_is_small_and_accumulates() -> None:
    config = get_recipe("micro")
    assert config.model.hidden_size == 64 and config.model.num_hidden_layers == 2
    assert config.train.steps == 20
    assert config.train.grad_accum > 1
    assert config.train.steps // config.optim.update_proj_gap >= 2  # crosses subspace refreshes


def test_recipes_are_fresh_objects_and_names_are_case_insensitive() -> None:
    first = get_recipe("micro")
    first.train.steps = 999
    assert get_recipe("MICRO").train.steps == 20


def test_unknown_recipe_lists_the_recipes() -> None:
    with pytest.raises(ValueError, match="unknown recipe 'huge'") as err:
        get_recipe("huge")
    for name in RECIPES:
        assert name in str(err.value)
