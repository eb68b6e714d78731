"""Resumable training batch streams: the :class:`BatchStream` interface, its state checks, and
:class:`PackedBatchStream` over an in-memory token array."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fira_train.data.spec import require_epoch_order, require_int


class BatchStream(ABC):
    """Infinite, deterministic iterator of ``LongTensor[batch_size, seq_len]`` training batches.

    ``state_dict()`` holds plain ints; a fresh stream of the same corpus and seed that loads it
    yields exactly the sequences the saved stream would have yielded next, in batches of its own
    size (the epochs as the saved stream cut them). ``corpus``
    identifies the corpus it reads (a fingerprint of its text, split and tokenizer) and ``token_digest``
    the ids it reads (their digest); each None where it is not known. A checkpoint records both,
    to tell other data from its own.
    """

    corpus: str | None = None
    token_digest: str | None = None

    def __iter__(self) -> BatchStream:
        return self

    @abstractmethod
    def __next__(self) -> torch.Tensor: ...

    @abstractmethod
    def state_dict(self) -> dict[str, int]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, int]) -> None: ...


ORDER_RULE = 2
"""The rule :func:`epoch_seed` follows in streams built today; a stream state records it as
``"order"`` (a state saved without it follows rule 1)."""


def epoch_seed(seed: int, epoch: int, rule: int = ORDER_RULE) -> int:
    """The shuffling seed of epoch ``epoch`` of a stream seeded ``seed``.

    Rule 1 was ``seed + epoch``: epoch ``e`` of seed ``s`` was epoch ``e - 1`` of seed ``s + 1``,
    so runs at consecutive seeds saw the same batch orders one epoch apart, and on a corpus of
    few batches per epoch their data order was nearly the same. Rule 2 keeps ``seed`` for epoch 0
    (a run's first epoch, all of a run shorter than an epoch, is as under rule 1) and draws every
    later epoch's seed from ``numpy.random.SeedSequence([seed, epoch])`` (64 bits), so no two
    (seed, epoch) pairs share an order in practice.
    """
    if rule == 1:
        return seed + epoch
    if epoch == 0:
        return seed
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])


def order_rule(state: Mapping[str, object], owner: str) -> tuple[int, dict[str, object]]:
    """``(rule, the state without its "order" key)``: rule 1 for a state saved before streams
    recorded their rule. ValueError naming the key unless the rule is 1 or 2."""
    if not isinstance(state, Mapping):
        return 1, state  # check_stream_state names what it is
    rule = state.get("order", 1)
    try:
        require_epoch_order(f"{owner} state['order']", rule)
    except ValueError as err:
        raise ValueError(f"{err} (a state written by a newer fira-train?)") from None
    return rule, {k: v for k, v in state.items() if k != "order"}


def check_stream_args(batch_size: object, seed: object, order: object = ORDER_RULE, cut: object = None) -> int:
    """The batches that cut a stream's epochs (``cut``, else ``batch_size``); ValueError naming the
    argument unless ``batch_size >= 1``, ``cut >= 1`` and ``seed >= 0`` are ints and ``order`` is
    a rule of :func:`epoch_seed` (1 or 2)."""
    require_int("batch_size", batch_size, 1)
    require_int("seed", seed, 0)
    require_epoch_order("order", order)
    cut = batch_size if cut is None else cut
    require_int("cut", cut, 1)
    return cut


def check_batch_end(owner: str, cut: int, into: int, unit: str) -> None:
    """ValueError unless a stream about to save its state is ``into = 0`` ``unit`` into its current
    batch of ``cut`` (a state records no position inside one)."""
    if into:
        raise ValueError(f"{owner}: a state is saved where a batch of the saved size {cut} ends; this one is "
                         f"{into} {unit} into one")


def check_stream_state(
    state: object, fixed: Mapping[str, int], position: Sequence[str], owner: str
) -> dict[str, int]:
    """Validate a saved stream state: exact keys, non-negative ints, ``fixed`` values unchanged.

    Raises ValueError naming the offending key (e.g. resuming with another seed or sequence
    length, which would silently change the data).
    """
    keys = sorted({*fixed, *position})
    if not isinstance(state, Mapping) or sorted(state) != keys:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{owner} state must have exactly the keys {keys}, got {got}")
    for key in keys:  # a batch size (the cut of a state) of at least one
        require_int(f"{owner} state[{key!r}]", state[key], 1 if key == "batch_size" else 0)
    for key, value in fixed.items():
        if state[key] != value:
            raise ValueError(
                f"cannot resume {owner}: the saved state has {key}={state[key]} but this stream has "
                f"{key}={value}; build the stream with the saved {key}"
            )
    return {key: int(state[key]) for key in keys}


class PackedBatchStream(BatchStream):
    """Batches of an in-memory token stream cut into ``seq_len`` blocks.

    Epoch ``e`` visits the ``n = len(tokens) // seq_len`` blocks in the order
    ``torch.randperm(n, generator=manual_seed(epoch_seed(seed, e)))``, ``cut`` at a time (default
    ``batch_size``; a run's whole step, ``train.batch_size``, so that its micro-batch size does not
    change its data); the last ``n mod cut`` blocks of each order are skipped. The batches yielded
    hold ``batch_size`` blocks each, one running on into the next epoch where ``batch_size`` does
    not divide the epoch. The position is ``(epoch, index)``: the next batch of ``cut`` blocks is
    number ``index`` of epoch ``epoch``; a state keeps ``cut`` as its ``batch_size``, is saved only
    where such a batch ends, and a stream that loads one takes its cut (a run resumed with another
    micro-batch size, or saved before the cut was the step's).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 corpus: str | None = None, token_digest: str | None = None, order: int = ORDER_RULE,
                 cut: int | None = None) -> None:
        cut = check_stream_args(batch_size, seed, order, cut)
        self.corpus, self.token_digest = corpus, token_digest
        n_blocks = len(tokens) // seq_len
        self._blocks = tokens[: n_blocks * seq_len].reshape(n_blocks, seq_len)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._cut_at(cut, f"batch_size={cut}" if cut == batch_size else
                     f"a step of {cut} sequences (the epochs are cut in whole steps, at any micro-batch size)")
        self.epoch = 0
        self.row = 0  # blocks of this epoch's order served
        self.order = order  # epoch_seed's rule; a resumed stream keeps the rule its state was saved with
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _cut_at(self, cut: int, what: str) -> None:
        """Epochs of whole batches of ``cut`` blocks (``what`` names it in the error)."""
        n_blocks = len(self._blocks)
        if n_blocks // cut == 0:
            raise ValueError(
                f"{what} exceeds the {n_blocks} training sequences of seq_len={self.seq_len} "
                f"({n_blocks * self.seq_len}+ tokens); lower batch_size or seq_len, or use more data"
            )
        self.cut = cut
        self.batches_per_epoch = n_blocks // cut  # of the cut's size
        self._rows_per_epoch = self.batches_per_epoch * cut

    @property
    def index(self) -> int:
        """The next batch's number in its epoch (in batches of :attr:`cut` blocks)."""
        return self.row // self.cut

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch, self.order))
            self._order = torch.randperm(len(self._blocks), generator=generator).numpy()
            self._order_epoch = self.epoch
        return self._order

    def __next__(self) -> torch.Tensor:
        parts, wanted = [], self.batch_size
        while wanted:
            if self.row >= self._rows_per_epoch:
                self.epoch, self.row = self.epoch + 1, 0
            taken = min(wanted, self._rows_per_epoch - self.row)
            parts.append(self._epoch_order()[self.row : self.row + taken])
            self.row, wanted = self.row + taken, wanted - taken
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return torch.from_numpy(np.asarray(self._blocks[rows], dtype=np.int64))  # (B, T)

    def state_dict(self) -> dict[str, int]:
        check_batch_end(type(self).__name__, self.cut, self.row % self.cut, "blocks")
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.cut,
            "seq_len": self.seq_len,
            "sequences": len(self._blocks),
            "order": self.order,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        owner = type(self).__name__
        fixed = {"seed": self.seed, "seq_len": self.seq_len, "sequences": len(self._blocks)}
        rule, state = order_rule(state, owner)
        checked = check_stream_state(state, fixed, ("epoch", "index", "batch_size"), owner)
        cut = checked["batch_size"]
        if checked["index"] > len(self._blocks) // cut:
            raise ValueError(
                f"{owner} state['index']={checked['index']} exceeds the "
                f"{len(self._blocks) // cut} batches of an epoch"
            )
        self._cut_at(cut, f"{owner} state['batch_size']={cut}")
        self.epoch, self.row, self.order = checked["epoch"], checked["index"] * cut, rule
        self._order_epoch = -1
