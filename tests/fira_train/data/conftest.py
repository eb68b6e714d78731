"""Fixtures of the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fira_train.data.data_fixtures import make_docs, write_jsonl


@pytest.fixture
def jsonl_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    docs = make_docs(60)
    return write_jsonl(tmp_path / "corpus.jsonl", docs), docs
