r"""SlimAdam (Kalra et al., 2025, "When Can You Get Away with Low Memory Adam?"), written here.

SlimAdam is AdamW whose second moment :math:`v` of a weight is replaced, along the dimensions
where the paper's layer-wise signal-to-noise analysis finds it nearly constant, by its mean
along them: for an ``m x n`` weight compressed along dimension ``k`` the optimizer keeps the
full ``m x n`` first moment and the EMA of ``mean_k(g * g)``, a vector of the *kept*
dimension (``1 x n`` for ``k = 0``, ``m x 1`` for ``k = 1``), broadcast in the update:

.. math::
    m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1 - \beta_2)\, \mathrm{mean}_k(g_t \odot g_t),

    W_t = W_{t-1}(1 - \eta\lambda)
          - \frac{\eta}{1 - \beta_1^t} \frac{m_t}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}.

With no dimension compressed it is AdamW, in the same floating-point operations as
``torch.optim.AdamW(foreach=False)`` (so the two agree bit for bit: tested).

Which dimension, per layer type (:func:`compressed_dims`): the paper's Table 1, as the authors'
repository applies it in its "static mode" (``DEFAULT_COMPRESSION_RULES`` and ``layer_map.json``
of github.com/ml-conf-authors/low-memory-adam; read there, not copied). For an ``nn.Linear``
weight ``(out, in)``, dimension 1 is the fan-in and 0 the fan-out:

=====================================  ==============  ======================
layer (LLaMA module name)              compressed dim  second moment kept
=====================================  ==============  ======================
query, key (``q_proj``, ``k_proj``)    1 (fan-in)      ``out x 1``
value, output (``v_proj``, ``o_proj``) 0 (fan-out)     ``1 x in``
MLP up, gate, down                     0 (fan-out)     ``1 x in``
token embedding (``embed_tokens``)     1 (width)       ``vocab x 1`` (per token)
output head (``lm_head``)              1 (fan-in)      ``vocab x 1`` (per token)
norms, any other tensor                none            full (Adam)
=====================================  ==============  ======================

The paper's recommended mode derives the rules from an SNR measurement of an Adam run of the
same recipe ("SNR auto mode"); that measurement is not implemented here: the static table is
the rule set the authors ship for standard architectures. Their code decays only tensors with
two or more dimensions; here ``weight_decay`` applies to every parameter, as the harness's
``adamw`` does (the paper's pre-training runs use 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

#: Why ``train.parallel="fsdp2"`` is refused.
FSDP2_REASON = ("SlimAdamW is not tested on FSDP2's row-sharded DTensors (its means over the fan-out "
                "dimension span every shard)")

#: Layer type -> substrings of the parameter name (LLaMA's names, as in the authors' ``layer_map.json``).
LAYER_NAMES: dict[str, tuple[str, ...]] = {
    "attention_query": ("q_proj",),
    "attention_key": ("k_proj",),
    "attention_value": ("v_proj",),
    "attention_output": ("o_proj",),
    "mlp_up": ("up_proj",),
    "mlp_gate": ("gate_proj",),
    "mlp_down": ("down_proj",),
    "token_embedding": ("embed_tokens",),
    "lm_head": ("lm_head",),
    "norm": ("norm",),
}
#: Layer type -> the dimensions whose second moment is averaged (the paper's Table 1).
COMPRESSION_RULES: dict[str, tuple[int, ...] | None] = {
    "attention_query": (1,),
    "attention_key": (1,),
    "attention_value": (0,),
    "attention_output": (0,),
    "mlp_up": (0,),
    "mlp_gate": (0,),
    "mlp_down": (0,),
    "token_embedding": (1,),
    "lm_head": (1,),
    "norm": None,
}


def layer_type(name: str) -> str | None:
    """The layer type of parameter ``name`` (a key of :data:`LAYER_NAMES`), or None."""
    for kind, patterns in LAYER_NAMES.items():
        if any(pattern in name for pattern in patterns):
            return kind
    return None


def compressed_dims(name: str, param: torch.Tensor) -> tuple[int, ...] | None:
    """The dimensions SlimAdam averages the second moment of ``param`` (named ``name``) over.

    None (full Adam) for norms, tensors of another layer type and anything that is not 2-D.
    """
    if param.dim() != 2:
        return None
    kind = layer_type(name)
    return None if kind is None else COMPRESSION_RULES[kind]


def slimadam_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """One param group per compression rule (``compress_dims``), trainable parameters only,
    tied weights once (under the first name, so a tied head follows the embedding's rule)."""
    groups: dict[tuple[int, ...] | None, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():  # named_parameters() yields a tied tensor once
        if param.requires_grad:
            groups.setdefault(compressed_dims(name, param), []).append(param)
    return [{"params": params, "compress_dims": dims} for dims, params in groups.items()]


class SlimAdamW(torch.optim.Optimizer):
    """AdamW with the second moment averaged over each group's ``compress_dims`` (see the module).

    Args:
        params: parameters or param groups; a group's ``compress_dims`` (a tuple of dimensions,
            or None for none) defaults to the constructor's.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        compress_dims: the default ``compress_dims`` of a group.

    State per parameter: ``exp_avg`` (the parameter's shape), ``exp_avg_sq`` (the parameter's
    shape with every compressed dimension of size 1) and ``step``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        compress_dims: tuple[int, ...] | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got lr={lr!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got betas={betas!r}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got eps={eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got weight_decay={weight_decay!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "compress_dims": compress_dims}
        super().__init__(params, defaults)
        for group in self.param_groups:
            dims = group["compress_dims"]
            if dims is not None:
                group["compress_dims"] = tuple(int(d) for d in dims)
                for p in group["params"]:
                    if any(not -p.dim() <= d < p.dim() for d in group["compress_dims"]):
                        raise ValueError(f"compress_dims={dims!r} do not fit a parameter of shape "
                                         f"{tuple(p.shape)}")

    @staticmethod
    def _squared(grad: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
        if dims is None:
            return grad * grad
        return (grad * grad).mean(dim=dims, keepdim=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 (torch.optim.Optimizer.step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            dims = group["compress_dims"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("SlimAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    shape = list(p.shape)
                    for d in dims or ():
                        shape[d] = 1
                    state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                if weight_decay != 0:
                    p.mul_(1 - lr * weight_decay)
                # torch.optim.AdamW's single-tensor arithmetic, operation for operation
                exp_avg.lerp_(grad, 1 - beta1)
                if dims is None:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    exp_avg_sq.mul_(beta2).add_(self._squared(grad, dims), alpha=1 - beta2)
                step = state["step"].item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


def second_moment_numel(shape: tuple[int, ...], dims: tuple[int, ...] | None) -> int:
    """Elements of SlimAdam's second moment for a tensor of ``shape`` compressed over ``dims``."""
    kept = list(shape)
    for d in dims or ():
        kept[d] = 1
    total = 1
    for size in kept:
        total *= size
    return total


__all__ = [
    "COMPRESSION_RULES",
    "FSDP2_REASON",
    "LAYER_NAMES",
    "SlimAdamW",
    "compressed_dims",
    "layer_type",
    "second_moment_numel",
    "slimadam_param_groups",
]
