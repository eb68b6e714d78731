"""The model: a randomly initialised ``transformers.LlamaForCausalLM`` (RMSNorm, SwiGLU, RoPE)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import LlamaConfig

if TYPE_CHECKING:  # annotations only: the config validates method names against the registry
    from transformers import LlamaForCausalLM

    from fira_train.config.run_config import ModelConfig


def llama_config(config: ModelConfig, vocab_size: int, max_seq_len: int) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` for ``config`` with the tokenizer's vocabulary."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size!r}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_hidden_layers=config.num_hidden_layers,
        num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
        hidden_act="silu",  # SwiGLU: down(silu(gate(x)) * up(x))
        max_position_embeddings=max_seq_len,
        initializer_range=config.initializer_range,
        rms_norm_eps=1e-6,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_dropout=0.0,
        use_cache=False,
    )


def build_model(config: ModelConfig, vocab_size: int, max_seq_len: int, seed: int,
                dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` whose random initialisation depends only on ``seed``.

    The global torch generator is reseeded here, so two calls with the same arguments give
    bit-identical weights whatever ran before.

    ``dtype=torch.bfloat16`` builds the weights (and buffers) in bf16 from the start: the
    same values, bit for bit, as ``build_model(...).to(torch.bfloat16)`` (a test checks
    it), without that path's transient fp32 copy of the whole model, twice the size of the
    bf16 weights, which would otherwise be the peak of a bf16 run's memory.
    """
    # imported here: the modeling code pulls in transformers' quantizers (and torchao, where
    # installed), which a command that stops before building a model should not load
    from transformers import LlamaForCausalLM

    hf_config = llama_config(config, vocab_size, max_seq_len)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # torch's own way to allocate a module's tensors in a dtype
    try:
        model = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype)  # buffers computed in fp32 whatever the default (RoPE's inv_freq)
    model.config.use_cache = False
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
