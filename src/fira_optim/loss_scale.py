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

import math
from typing import Any

import torch


class LossScale:
    """The scale of :func:`fira_optim.step_in_backward` (``loss_scale=``), with GradScaler's
    defaults: ``init_scale=2**16``, ``growth_factor=2``, ``backoff_factor=0.5``,
    ``growth_interval=2000``; ``dynamic=False`` keeps ``init_scale`` throughout."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True) -> None:
        checks = (("init_scale", init_scale, 0.0, math.inf), ("growth_factor", growth_factor, 1.0, math.inf),
                  ("backoff_factor", backoff_factor, 0.0, 1.0))
        for name, value, low, high in checks:
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not low < value or (high < math.inf and not value < high)):
                bounds = f"in ({low:g}, {high:g})" if high < math.inf else f"> {low:g}"
                raise ValueError(f"{name} must be a finite number {bounds}, got {name}={value!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got growth_interval={growth_interval!r}")
        if not isinstance(dynamic, bool):
            raise ValueError(f"dynamic must be True or False, got dynamic={dynamic!r}")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.dynamic = growth_interval, dynamic
        self._scale = torch.full((1,), float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        self._found_inf = torch.zeros(1, dtype=torch.float32)  # since the last update()
        self.skipped = 0
        """Updates skipped for an overflow since the handle was made (matrices, not steps)."""

    def get_scale(self) -> float:
        """The current scale :math:`S` (a host sync on a GPU)."""
        return float(self._scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: call ``.backward()`` on this."""
        self._to(loss.device)
        return loss * self._scale  # as GradScaler.scale: a (1,)-shaped fp32 tensor

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by :math:`S` in place; False (and the step's overflow is recorded)
        if one of them holds Inf or NaN, after which they must not be used."""
        if not grads:
            return True
        inv_scale = self._scale.double().reciprocal().float()  # as GradScaler.unscale_
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for device, tensors in by_device.items():
            here = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, here, inv_scale.to(device))
            found += here.to(found.device)
        if bool(found):  # the update waits for this answer anyway
            self._found_inf.fill_(1.0)
            self.skipped += 1
            return False
        return True

    def update(self) -> None:
        """Once per optimizer step: back off after an overflow, grow after ``growth_interval``
        clean steps (``dynamic=False``: nothing changes)."""
        if self.dynamic:
            found = self._found_inf.to(self._scale.device)
            torch._amp_update_scale_(self._scale, self._growth_tracker, found, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)
        self._found_inf.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Plain values (``torch.load(weights_only=True)`` reads them), as GradScaler's."""
        return {"scale": self.get_scale(), "growth_tracker": int(self._growth_tracker),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"a loss-scale state needs {sorted(missing)}, got keys {sorted(state)}")
        LossScale(state["scale"], state.get("growth_factor", self.growth_factor),  # validates the values
                  state.get("backoff_factor", self.backoff_factor),
                  state.get("growth_interval", self.growth_interval), state.get("dynamic", self.dynamic))
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.dynamic = bool(state.get("dynamic", self.dynamic))

    def _to(self, device: torch.device) -> None:
        """Keep the scale where the loss is (the first ``scale()`` call moves it)."""
        if self._scale.device != device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
            self._found_inf = self._found_inf.to(device)
