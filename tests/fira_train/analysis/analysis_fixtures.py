"""Shared by the analysis tests: one micro corpus and tokenizer cache per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from fira_train.config.overrides import apply_overrides
from fira_train.config.run_config import RunConfig
from tests.fira_train.harness_fixtures import micro_config


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the micro test corpus and its tokenizer cache (built once)."""
    return tmp_path_factory.mktemp("analysis-corpus")


def analysis_config(root: Path, out: Path, *overrides: str) -> RunConfig:
    """The micro recipe on the shared corpus, no evaluation or checkpoints until the end."""
    config = micro_config(root, "train.eval_every=0", "train.save_every=0", *overrides)
    return apply_overrides(config, [f"train.out_dir={out}"])
