"""The LLaMA model: seeded random init, RMSNorm + SwiGLU, vocabulary from the tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from fira_train.config.run_config import ModelConfig
from fira_train.methods.model import build_model, count_parameters

SMALL = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1)


def test_same_seed_same_weights_different_seed_different() -> None:
    a = build_model(SMALL, vocab_size=100, max_seq_len=16, seed=3)
    torch.rand(10)  # global generator state before the call must not matter
    b = build_model(SMALL, vocab_size=100, max_seq_len=16, seed=3)
    c = build_model(SMALL, vocab_size=100, max_seq_len=16, seed=4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))


def test_architecture_is_llama_with_swiglu_and_rmsnorm() -> None:
    model = build_model(SMALL, vocab_size=100, max_seq_len=16, seed=0)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.hidden_act == "silu"
    layer = model.model.layers[0]
    assert {"gate_proj", "up_proj", "down_proj"} <= {n for n, _ in layer.mlp.named_children()}
    assert "RMSNorm" in type(layer.input_layernorm).__name__
    assert model.get_input_embeddings().weight.shape == (100, 32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied, as in the paper
    logits = model(input_ids=torch.randint(0, 100, (2, 16))).logits
    assert logits.shape == (2, 16, 100)


def test_parameter_count_counts_tied_weights_once() -> None:
    tied = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_hidden_layers=1, tie_word_embeddings=True), 100, 16, 0)
    untied = build_model(SMALL, 100, 16, 0)
    assert count_parameters(untied) - count_parameters(tied) == 100 * 32


def test_tiny_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_model(SMALL, vocab_size=1, max_seq_len=16, seed=0)
