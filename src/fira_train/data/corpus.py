"""Corpora: a tokenizer, training batch streams and a fixed validation set (:class:`Corpus`), and
:class:`PackedCorpus`, whose training tokens fit in memory (or a memory-mapped cache file)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fira_train.data.spec import DataSpec, require_int
from fira_train.data.streams import BatchStream, PackedBatchStream


class Corpus(ABC):
    """A tokenized corpus: a tokenizer, training batch streams and a fixed validation set."""

    def __init__(
        self, spec: DataSpec, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, val_tokens: np.ndarray
    ) -> None:
        needed = spec.val_sequences * spec.seq_len
        if len(val_tokens) < needed:
            raise ValueError(f"validation tokens: need {needed}, got {len(val_tokens)}")
        self.spec = spec
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self._val_blocks = np.asarray(val_tokens[:needed], dtype=np.int64).reshape(spec.val_sequences, spec.seq_len)

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the rows the model's embedding must hold (may be below ``spec.vocab_size``)."""
        return len(self.tokenizer)

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @abstractmethod
    def train_batches(self, batch_size: int, seed: int) -> BatchStream:
        """A fresh training stream positioned at its start (load a state to resume)."""

    def val_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The fixed validation set, ``val_sequences`` sequences in ``LongTensor[B, seq_len]`` batches.

        The sequences and their order do not depend on any seed; only the last batch can be
        smaller than ``batch_size`` (when it does not divide ``val_sequences``).
        """
        require_int("batch_size", batch_size, 1)
        blocks = torch.from_numpy(self._val_blocks.copy())
        return list(blocks.split(batch_size))

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """``{"source", "train_tokens", "val_tokens", "tokenizer", "vocab_size", "seq_len"}``."""

    def _describe(self, train_tokens: int | None) -> dict[str, Any]:
        return {
            "source": self.spec.source,
            "train_tokens": train_tokens,
            "val_tokens": int(self._val_blocks.size),
            "tokenizer": self.tokenizer_name,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
        }


class PackedCorpus(Corpus):
    """A corpus whose training tokens fit in memory (or a memory-mapped cache file)."""

    def __init__(
        self,
        spec: DataSpec,
        tokenizer: PreTrainedTokenizerBase,
        tokenizer_name: str,
        train_tokens: np.ndarray,
        val_tokens: np.ndarray,
    ) -> None:
        super().__init__(spec, tokenizer, tokenizer_name, val_tokens)
        if spec.max_train_tokens is not None:
            train_tokens = train_tokens[: spec.max_train_tokens]
        if len(train_tokens) < spec.seq_len:
            raise ValueError(
                f"the training split of {spec.source!r} holds {len(train_tokens)} tokens, fewer than "
                f"seq_len={spec.seq_len}"
            )
        self.train_tokens = train_tokens

    def train_batches(self, batch_size: int, seed: int) -> PackedBatchStream:
        return PackedBatchStream(self.train_tokens, self.seq_len, batch_size, seed)

    def describe(self) -> dict[str, Any]:
        return self._describe(len(self.train_tokens) // self.seq_len * self.seq_len)
