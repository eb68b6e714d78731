"""DataSpec: defaults, validation, the cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from fira_train.data.spec import DataSpec


def test_dataspec_defaults_match_the_contract() -> None:
    spec = DataSpec()
    assert (spec.source, spec.tokenizer, spec.vocab_size, spec.seq_len) == ("wiki", "bpe", 8192, 256)
    assert (spec.val_fraction, spec.val_sequences, spec.max_train_tokens, spec.cache_dir) == (0.02, 64, None, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("source", ""),
        ("source", 3),
        ("source", "c4:"),
        ("tokenizer", ""),
        ("vocab_size", 100),
        ("vocab_size", True),
        ("vocab_size", 8192.0),
        ("seq_len", 1),
        ("seq_len", "256"),
        ("val_fraction", 0.0),
        ("val_fraction", 1.0),
        ("val_fraction", float("nan")),
        ("val_fraction", True),
        ("val_sequences", 0),
        ("test_fraction", -0.1),
        ("test_fraction", 0.98),  # with val_fraction 0.02 nothing is left to train on
        ("test_fraction", float("nan")),
        ("test_fraction", True),
        ("test_sequences", 0),
        ("max_train_tokens", 0),
        ("max_train_tokens", 10.5),
        ("epoch_order", 0),
        ("epoch_order", 3),
        ("epoch_order", True),
        ("epoch_order", "2"),
        ("epoch_order", 1.0),
        ("cache_dir", ""),
    ],
)
def test_dataspec_rejects_bad_values_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        DataSpec(**{field: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert f"data.{field}" in message and repr(value) in message  # the key as an override writes it


def test_test_sequences_need_a_test_split() -> None:
    with pytest.raises(ValueError, match="test_sequences=4 .*test_fraction=0"):
        DataSpec(test_fraction=0.0, test_sequences=4)
    assert (DataSpec().test_fraction, DataSpec().test_sequences) == (0.02, None)


def test_dataspec_accepts_paths_and_hf_vocab(tmp_path: Path) -> None:
    spec = DataSpec(source=tmp_path, cache_dir=tmp_path, tokenizer="t5-base", vocab_size=1)  # type: ignore[arg-type]
    assert spec.source == str(tmp_path) and spec.cache_dir == str(tmp_path)
    assert spec.resolved_cache_dir() == tmp_path


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FIRA_CACHE", str(tmp_path / "c"))
    assert DataSpec().resolved_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FIRA_CACHE")
    assert DataSpec().resolved_cache_dir() == Path.home() / ".cache" / "fira-train"
