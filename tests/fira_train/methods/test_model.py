"""The LLaMA model: seeded random init, RMSNorm + SwiGLU, vocabulary from the tokenizer."""

from __future__ import annotations

import subprocess
import sys

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


def test_bf16_build_equals_fp32_build_cast_bit_for_bit() -> None:
    config = ModelConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=2)
    cast = build_model(config, 300, 32, seed=5).to(torch.bfloat16)
    direct = build_model(config, 300, 32, seed=5, dtype=torch.bfloat16)
    a = dict(cast.named_parameters()) | dict(cast.named_buffers())
    b = dict(direct.named_parameters()) | dict(direct.named_buffers())
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        assert b[name].dtype == tensor.dtype, name
        assert torch.equal(b[name], tensor), name
    assert all(p.dtype == torch.bfloat16 for p in direct.parameters())
    assert torch.get_default_dtype() == torch.float32  # restored


_BUILD_PEAK = """
import sys, torch
from fira_train.config.run_config import ModelConfig
from fira_train.methods.model import build_model
from fira_train.run.peak_memory import reset_rss_peak, rss_peak_bytes, current_rss_bytes
import transformers.models.llama.modeling_llama
config = ModelConfig(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_hidden_layers=8)
reset_rss_peak(); before = current_rss_bytes()
model = build_model(config, 8000, 64, 0, torch.bfloat16)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(weights, rss_peak_bytes() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bf16_build_never_holds_the_fp32_model() -> None:
    # in a fresh process: this one's freed heap would hide a transient allocation
    out = subprocess.run([sys.executable, "-c", _BUILD_PEAK], capture_output=True, text=True, check=True)
    weights, peak = map(int, out.stdout.split()[-2:])
    assert weights > 60e6  # ~34M bf16 parameters: large enough to dwarf the allocator's noise
    assert peak < 1.5 * weights  # the fp32-then-cast path peaks at 2x (fp32 model + casts)
