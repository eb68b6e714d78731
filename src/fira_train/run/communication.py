"""Counting the collectives a rank issues and their bytes (:class:`CommunicationCounter`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


class CommunicationCounter:
    """Count the collectives this rank issues and their payload, by kind.

    Patches ``torch.distributed``'s Python collectives (what FSDP2 and Fira call) while the
    context is open; DDP's C++ reducer bypasses them, so :meth:`watch_ddp` registers a comm
    hook that counts its gradient buckets. The payload of a collective is the full logical
    tensor it produces or consumes: the tensor of an all-reduce or broadcast, the output of an
    all-gather, the input of a reduce-scatter, all the pieces of a gather. A ring algorithm
    moves about that many bytes per rank (twice for an all-reduce).
    """

    _PATCHED = ("all_reduce", "broadcast", "gather", "all_gather", "all_gather_single",
                "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}
        self.enabled = False

    def record(self, kind: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def __enter__(self) -> "CommunicationCounter":
        for name in self._PATCHED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        self.enabled = True
        return self

    def __exit__(self, *exc: Any) -> bool:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        self.enabled = False
        return False

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any):
            self.record(name, _payload(name, args, kwargs))
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def watch_ddp(self, ddp_model: nn.Module) -> None:
        """Count a DDP model's gradient all-reduces (register before its first backward)."""
        counter = self

        def hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
            buffer = bucket.buffer()
            counter.record("ddp_all_reduce", buffer.numel() * buffer.element_size())
            enabled, counter.enabled = counter.enabled, False  # the all_reduce inside: once
            try:
                return allreduce_hook(state, bucket)
            finally:
                counter.enabled = enabled

        ddp_model.register_comm_hook(None, hook)


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        if hasattr(t, "to_local"):
            t = t.to_local()
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("all_gather_single", "all_gather_into_tensor", "all_gather"):
        return _nbytes(first)  # the output: the whole gathered tensor
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        source = args[1] if len(args) > 1 else kwargs.get("input")
        return _nbytes(source)  # the input: the whole unreduced tensor
    if name == "gather":
        world = dist.get_world_size(kwargs.get("group"))
        return _nbytes(first) * world
    return _nbytes(first)
