r"""Loss scaling for updates inside the backward pass (fp16 autocast).

fp16 gradients of small magnitude round to zero, so fp16 training multiplies the loss by a
scale :math:`S` before the backward pass and divides each gradient by :math:`S` before the
update. ``torch.amp.GradScaler`` divides all gradients at once after the backward pass
(``scaler.step``); with :func:`fira_optim.step_in_backward` the gradients are used and freed
during the backward pass, so each update divides its own gradients first: :class:`LossScale`.

The arithmetic is GradScaler's, by the same kernels: gradients are unscaled by
:math:`S^{-1}` (``torch._amp_foreach_non_finite_check_and_unscale_``), which also finds
Inf/NaN, and the scale is updated once per optimizer step (``torch._amp_update_scale_``):

.. math::
    S \leftarrow \begin{cases} S \cdot \text{backoff} & \text{if a gradient of the step overflowed} \\
    S \cdot \text{growth} & \text{after growth\_interval steps in a row without one} \\
    S & \text{otherwise.} \end{cases}

What differs is what an overflow skips: GradScaler skips the whole step; in the backward pass
the matrices updated before the overflowing one are already updated, so only the updates whose
gradients overflowed are skipped (each matrix counts its own steps, as for ``nonfinite="skip"``).
With a static scale (``dynamic=False``) that never overflows, the weights equal those of
GradScaler with the same constant scale and a plain ``optimizer.step()``, bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Any, Iterator

import torch

from .options import _integer


#: Backward passes run in several threads at once count under it (a module's lock: a LossScale
#: stays deep-copyable and picklable, see LossScale.__getstate__).
_PASSES_LOCK = threading.Lock()

#: The scales float32 holds: a smaller one is 0, a larger one Inf.
_SCALE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


class LossScale:
    """The scale of :func:`fira_optim.step_in_backward` (``loss_scale=``), with GradScaler's
    defaults: ``init_scale=2**16``, ``growth_factor=2``, ``backoff_factor=0.5``,
    ``growth_interval=2000``; ``dynamic=False`` keeps ``init_scale`` throughout. One handle at a
    time uses it (two would move it twice per step)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True) -> None:
        _check_settings(init_scale, growth_factor, backoff_factor, growth_interval, dynamic)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.dynamic = _integer(growth_interval), dynamic
        self._scale = torch.full((1,), float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        self._inverse()
        self._overflowed = False  # since the last update()
        self._scaled = False  # scale() called since the last update(): the gradients are scaled
        self._scaled_passes = 0  # backward passes from a scaled loss running now (check_backward)
        self._open_blocks = 0  # scaled_backward() blocks entered and not left
        self.handle: Any = None
        """The :class:`~fira_optim.backward.StepInBackward` that uses this scale (None: none)."""
        self.skipped = 0
        """Parameter updates skipped for an overflow (kept in :meth:`state_dict`)."""

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickle) is a free scale: without the handle (and its
        optimizer and model) and without the passes and blocks running in this process."""
        state = dict(self.__dict__)
        state.update(handle=None, _scaled_passes=0, _open_blocks=0, _scaled=False, _overflowed=False)
        return state

    def get_scale(self) -> float:
        """The current scale :math:`S` (a host sync on a GPU)."""
        return float(self._scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: call ``.backward()`` on this."""
        self._to(loss.device)
        self._scaled = True
        scaled = loss * self._scale  # as GradScaler.scale: a (1,)-shaped fp32 tensor
        if scaled.requires_grad:  # marks the backward passes that start from it (check_backward)
            scaled.register_hook(self._backward_starts)
        return scaled

    def check_backward(self) -> None:
        """RuntimeError unless a backward pass from a :meth:`scale`-d loss runs (or a
        :meth:`scaled_backward` block is open): called by each update (and each accumulating
        micro-batch; under DDP by a check-only hook on each weight), where an unscaled backward would
        otherwise be divided by :math:`S` (or, accumulated with scaled ones, be weighted :math:`1/S`
        against them) without a word. The count is the scale's, not a pass's: an unscaled pass is not
        told apart while a scaled one runs in another thread, nor one with a scaled and an unscaled
        root (``(scaled + other).backward()``), nor one after a scaled pass that an error abandoned
        (it counts until the next ``optimizer.step()``). Not under compiled autograd, which runs no
        end-of-backward callback from a hook: there the step's check alone (:meth:`unscale_`)."""
        if not (self._scaled_passes or self._open_blocks or _compiled_autograd()):
            raise RuntimeError(_UNSCALED)

    @contextlib.contextmanager
    def scaled_backward(self) -> Iterator[None]:
        """Around backward passes whose gradients carry the scale without starting from
        :meth:`scale`'s tensor: one started from an intermediate tensor with a gradient computed
        from the scaled loss (``hidden.backward(h.grad)`` after a detached head's backward, a
        pipeline stage's ``torch.autograd.backward(outputs, grads)``). It may hold whole steps,
        and the gradients it leaves count as scaled until the next ``optimizer.step()``. While
        it is open every pass counts as scaled, in every thread (hooks run in autograd's device
        threads, not the caller's): keep it around those passes only."""
        self._count_blocks(+1)
        self._scaled = True
        try:
            yield
        finally:
            self._count_blocks(-1)
            self._scaled = True  # also where a step inside the block reset it

    def _backward_starts(self, grad: torch.Tensor) -> None:
        # The scaled loss's gradient comes first in its backward pass, before any weight's; the
        # count lasts until that pass ends (a nested backward, as reentrant activation
        # checkpointing runs, inside it). A pass abandoned by an error runs no end callback:
        # update() sets the count back to 0.
        self._scaled = True  # also a loss scaled before the step that came between
        if _compiled_autograd():
            return
        self._count(+1)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._count(-1))

    def _count(self, change: int) -> None:
        with _PASSES_LOCK:
            self._scaled_passes = max(0, self._scaled_passes + change)

    def _count_blocks(self, change: int) -> None:
        with _PASSES_LOCK:
            self._open_blocks += change

    def unscale_(self, grads: list[torch.Tensor]) -> list[bool]:
        """Divide each of ``grads`` by :math:`S` in place; whether each is finite after it (one
        host sync for all). A gradient found non-finite (an overflow, recorded for the step's
        :meth:`update`) must not be used. RuntimeError if no backward pass from a scaled loss
        (nor a :meth:`scaled_backward` block) came first in this step (the gradients would be
        divided by :math:`S` without having been multiplied), or for fp16 gradients, which cannot
        hold what the scale protected once divided (GradScaler refuses them too)."""
        if not grads:
            return []
        if not (self._scaled or self._open_blocks):
            raise RuntimeError(_UNSCALED)
        if any(grad.dtype == torch.float16 for grad in grads):
            raise RuntimeError(_FP16_GRADIENTS)
        found = torch.zeros(len(grads), dtype=torch.float32, device=self._scale.device)
        for i, grad in enumerate(grads):  # a flag each: an overflow skips its own parameter's update
            if grad.device == found.device:
                torch._amp_foreach_non_finite_check_and_unscale_([grad], found[i:i + 1], self._inv_scale)
            else:  # a model spread over devices
                flag = torch.zeros(1, dtype=torch.float32, device=grad.device)
                torch._amp_foreach_non_finite_check_and_unscale_([grad], flag, self._inv_scale.to(grad.device))
                found[i:i + 1].copy_(flag)
        overflowed = found.tolist()  # the one host sync; the update waits for this answer anyway
        if any(overflowed):
            self._overflowed = True
            self.skipped += sum(1 for f in overflowed if f)
        return [not f for f in overflowed]

    def update(self) -> None:
        """Once per optimizer step: back off after an overflow, grow after ``growth_interval``
        clean steps (``dynamic=False``: nothing changes)."""
        if self.dynamic:
            # float32 whatever torch's default dtype (the kernel takes nothing else)
            found = torch.full((1,), float(self._overflowed), dtype=torch.float32, device=self._scale.device)
            torch._amp_update_scale_(self._scale, self._growth_tracker, found, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)
            self._inverse()
        self._overflowed = False
        self._scaled = False
        with _PASSES_LOCK:  # outside backward: a pass an error abandoned counts no longer
            self._scaled_passes = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain values (``torch.load(weights_only=True)`` reads them); GradScaler's keys, so that
        ``torch.amp.GradScaler.load_state_dict`` takes it, and ``dynamic`` and ``skipped``."""
        return {"scale": self.get_scale(), "_growth_tracker": int(self._growth_tracker),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "dynamic": self.dynamic, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`, or a ``torch.amp.GradScaler``'s (the same keys), or one
        saved by an older release (its tracker under ``growth_tracker``)."""
        state = dict(state)
        if "growth_tracker" in state:  # an older release's name
            state.setdefault("_growth_tracker", state.pop("growth_tracker"))
        missing = {"scale", "_growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"a loss-scale state needs {sorted(missing)}, got keys {sorted(state)}")
        settings = {"growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                    "growth_interval": self.growth_interval, "dynamic": self.dynamic}
        settings.update({key: state[key] for key in settings if key in state})
        scale = state["scale"]
        # a scale backed off many times in a row lies below float32's normal range: still a scale
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
                or not 0 < scale <= _SCALE_RANGE[1]):
            raise ValueError(f"a loss-scale state's scale must be a finite number in (0, {_SCALE_RANGE[1]:.3g}], "
                             f"got scale={scale!r}")
        _check_settings(1.0, **settings)
        self._scale.fill_(float(state["scale"]))
        self._inverse()
        self._growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor, self.backoff_factor = float(settings["growth_factor"]), float(settings["backoff_factor"])
        self.growth_interval, self.dynamic = _integer(settings["growth_interval"]), settings["dynamic"]
        self.skipped = int(state.get("skipped", 0))  # a GradScaler's state has no count

    def _to(self, device: torch.device) -> None:
        """Keep the scale where the loss is (the first ``scale()`` call moves it)."""
        if self._scale.device != device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
            self._inverse()

    def _inverse(self) -> None:
        """:math:`1 / S` as GradScaler computes it (in float64, then float32), once per scale, not
        once per update in the backward pass."""
        self._inv_scale = self._scale.double().reciprocal().float()


def _compiled_autograd() -> bool:
    """Whether compiled autograd runs this backward pass (never if torch._dynamo is not loaded)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    flag = getattr(module, "in_compiled_autograd_region", False)
    return bool(flag() if callable(flag) else flag)


_UNSCALED = ("loss_scale: the gradients were not scaled: call handle.scale(loss).backward(), not "
             "loss.backward(), when step_in_backward has a loss_scale (every backward pass of the step, "
             "also those inside handle.accumulate()); a backward from a gradient that already carries "
             "the scale (a split or pipelined backward) goes inside `with handle.scaled_backward():`")

_FP16_GRADIENTS = ("loss_scale needs fp32 gradients (fp32 weights under fp16 autocast): an fp16 gradient "
                   "divided by the scale loses the small values the scale kept (GradScaler refuses them too); "
                   "keep the weights in fp32, or use bf16, which needs no scaling")


def check_scale(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is a scale float32 holds (neither 0 nor Inf)."""
    tiny, largest = _SCALE_RANGE
    if not (_finite_number(value) and tiny <= value <= largest):
        raise ValueError(f"{name} must be a finite number in [{tiny:.3g}, {largest:.3g}] (float32's range), "
                         f"got {name}={value!r}")


def _finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_settings(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
                    dynamic: Any) -> None:
    """ValueError naming the first setting out of its range."""
    check_scale("init_scale", init_scale)
    for name, value, low, high, bounds in (("growth_factor", growth_factor, 1.0, math.inf, "> 1"),
                                           ("backoff_factor", backoff_factor, 0.0, 1.0, "in (0, 1)")):
        if not (_finite_number(value) and low < value < high):
            raise ValueError(f"{name} must be a finite number {bounds}, got {name}={value!r}")
    if _integer(growth_interval) is None or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got growth_interval={growth_interval!r}")
    if not isinstance(dynamic, bool):
        raise ValueError(f"dynamic must be True or False, got dynamic={dynamic!r}")
