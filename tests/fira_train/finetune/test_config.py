"""The fine-tuning methods are a view of the method registry."""

from __future__ import annotations

from fira_train.finetune.config import DEFAULT_LR, METHODS, REGISTRY_METHODS
from fira_train.methods.registry import METHODS as REGISTRY


def test_finetune_methods_are_registry_entries_plus_none_and_fira_lora() -> None:
    assert set(REGISTRY_METHODS) <= set(REGISTRY)
    assert set(METHODS) - set(REGISTRY_METHODS) == {"none", "fira-lora"}
    assert set(DEFAULT_LR) == set(METHODS)
