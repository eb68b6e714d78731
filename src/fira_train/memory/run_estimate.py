r"""The memory of one training run, estimated from its config: what ``fira-train memory
--measure`` puts beside each measured peak.

.. math::
    \text{total} = \text{weights} + \text{gradients} + \text{optimizer states} + \text{activations}
        + \text{step temporaries}

- weights: every parameter at ``train.param_dtype`` (4 or 2 bytes);
- gradients: all of them at the weights' dtype; with ``optim.step_in_backward`` and one
  micro-batch per step only the largest parameter's (each gradient is freed as soon as its update
  has run; the largest, the embedding or the head, bounds what is alive at once); with gradient
  accumulation (``train.micro_batch_size`` below ``train.batch_size``) all of them again: the
  updates wait for the last micro-batch, and the gradients accumulated until then are alive;
- optimizer states: projected matrices (``rank < min(m, n)``, and for Fira-only-scaling any
  rank, at most ``min(m, n)``) with a basis ``min(m, n) x r``, Adam moments ``r x max(m, n)`` and
  Fira's one scalar (APOLLO, APOLLO-Mini, Flora and SlimAdam: their own states,
  :func:`_peer_state_numel`), everything else AdamW's two moments; a Fira-family variant on Adagrad or RMSProp (``fira-adagrad``, ...) keeps
  one moment instead of two for every parameter, and one that drops the residual (``galore``,
  ...) no limiter scalar; moments at 4 bytes (``float32``), 2 (``bfloat16``) or 1 + 4/256
  (``int8``; a moment below 4096 elements or not whole 256-element blocks at its working
  dtype: :func:`fira_optim.precision.moment_zeros` decides), the basis at 4 bytes, or 2 from
  ``bfloat16`` on; the
  plain torch optimizers (AdamW, ...), Adam-mini, APOLLO and SlimAdam keep their states at the
  weights' dtype (Flora fp32 whatever the weights), and so does the
  Fira family at ``float32`` for the parameters it does not project (bf16 moments of the
  embedding and head for bf16 weights, as ``torch.optim.AdamW`` keeps them);
- activations: per layer :math:`s b h (34 + 5 a s / h)` bytes in 16-bit (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022), twice that in fp32,
  plus the logits (:math:`4 \cdot 3 s b V`: logits, softmax, gradient); with activation
  checkpointing :math:`2 s b h` bytes per layer plus one layer's full activations;
- step temporaries: what the update of the largest parameter stepped in one piece allocates on
  top. The parameters that are not projected (all of them for torch's optimizers; the
  embedding, head and norms for the Fira family) are stepped by torch's per-parameter Adam
  (its default on the CPU), whose ``sqrt`` and division hold two parameter-sized temporaries at
  once: :math:`2 \cdot V h` elements at the weights' dtype. Low-precision states (and stochastic
  rounding) step through fp32 copies a chunk at a time (:data:`fira_optim.precision.CHUNK`
  elements, about 13 bytes each). Where it is more, the update of the projected matrix that
  allocates most (:func:`_matrix_step_bytes`): three fp32 ``r x max(m, n)`` terms (the projected
  gradient, Adam's direction and a temporary); on the reference path
  (``optim.implementation=reference``, and FRUGAL's sign residual) the scaled residual and the
  update as fp32 ``m x n`` matrices (8 bytes per element; GaLore's and Fira-only-scaling's one,
  4); for a bf16 matrix an fp32 working copy beside its fp32 gradient (8 bytes per element). On
  CUDA, outside ``optim.step_in_backward``, plus what the step keeps of every projected matrix
  from its plan to its update, all at once (:func:`_planned_bytes`; on the CPU these smaller
  terms reuse the heap the activations freed). They add to everything else because the memory the backward
  pass freed (the activations) stays in the process, in glibc's heap, while these temporaries,
  larger than its ``mmap`` threshold, are mapped afresh (``benchmarks/memory_phases.py``
  measures each phase: the step's own rise is :math:`2 \cdot V h \cdot 4` bytes at 60M). On
  CUDA (``device="cuda"``), torch's AdamW takes its multi-tensor (``foreach``) path by default,
  whose step holds :math:`\sqrt{v}` of every parameter at once: one temporary of all the
  weights' size, at their dtype, for ``adamw`` (for ``adamw-grouped`` the larger of its two
  groups: one ``foreach`` step per group); measured on an H200 with bf16 weights, AdamW's peak
  was 1.17 and 1.20 times the estimate without this term at 1B and 7B. LoRA's are the adapters'
  size, and the other plain optimizers' are not modelled. On CUDA, too, the allocator's peak
  (``max_memory_allocated``) counts live tensors only: the activations are freed before the
  step, so the total takes the larger of activations and step temporaries, not their sum (with
  ``optim.step_in_backward`` the steps run inside the backward pass, among the activations: the
  sum).

What the estimate leaves out is what the measurement shows on top: the framework's own memory
(the baseline before the model exists is subtracted from the measured peak, but not the
allocator's caches and the workspaces of BLAS / LAPACK) and the heap the allocator keeps beyond
the activations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fira_optim import precision
from fira_optim.options import Residual, StateDtype
from fira_optim.precision import CHUNK, CHUNK_TEMPORARY_BYTES
from fira_optim.projection import is_projected, projected_rank
from fira_optim.subspace import STATE_KEYS
from fira_optim.variants import VARIANTS
from fira_train.memory.matrix import PEER_METHODS, footprint_numel, llama_matrix_shapes, vector_state_numel

if TYPE_CHECKING:  # annotations only
    from fira_train.config.run_config import RunConfig

#: Methods that project their matrices (the Fira / GaLore family) and those that do not.
PLAIN_METHODS = ("adamw", "adamw-grouped", "sgd", "adagrad", "adam-mini", "lora", "relora")
#: Methods this estimate does not model: LoRA's adapters beside frozen weights (it would count
#: full-weight AdamW); their measured rows show no estimate.
UNESTIMATED_METHODS = ("lora", "relora")
#: Plain methods with one state per parameter (SGD's momentum buffer, Adagrad's sum), not two.
ONE_STATE_METHODS = ("sgd", "adagrad")
#: Plain methods whose weights torch.optim.AdamW steps, by default on CUDA in its ``foreach`` step.
FOREACH_METHODS = ("adamw", "adamw-grouped")


def is_estimated(method: str) -> bool:
    """Whether :func:`estimate_run_bytes` models ``method`` (see :data:`UNESTIMATED_METHODS`)."""
    return method not in UNESTIMATED_METHODS


def estimate_run_bytes(config: "RunConfig", vocab_size: int, device: str = "cpu") -> dict[str, Any]:
    """``{"weights", "gradients", "optimizer_states", "activations", "step_temporaries",
    "total"}`` in bytes. A method this estimate does not model (:func:`is_estimated`) is a
    ``ValueError``: a number for it would be full-weight AdamW's."""
    m, o, t = config.model, config.optim, config.train
    if not is_estimated(o.method):
        raise ValueError(f"optim.method={o.method!r}: the run estimate does not model it "
                         f"(not estimated: {', '.join(UNESTIMATED_METHODS)})")
    h, layers = m.hidden_size, m.num_hidden_layers
    weight_bytes = 2 if t.param_dtype == "bfloat16" else 4
    # grouped KV heads (model.num_key_value_heads) are counted as full heads: an upper bound
    shapes = llama_matrix_shapes(h, m.intermediate_size, layers)
    embed = vocab_size * h
    others = embed * (1 if m.tie_word_embeddings else 2) + h * (2 * layers + 1)  # + RMSNorms
    params = sum(a * b for a, b in shapes) + others
    largest = max([a * b for a, b in shapes] + [embed])
    # updates in the backward pass wait for the last micro-batch: the accumulated gradients live until then
    gradients = (largest if o.step_in_backward and t.grad_accum == 1 else params) * weight_bytes
    projected = o.method not in PLAIN_METHODS
    # a Fira-family variant keeps its base's moments (Adagrad's and RMSProp's one, Adam's two)
    # for every parameter, and the limiter's norm only where it keeps the residual
    variant = VARIANTS.get(o.method, {})
    moments = (len(STATE_KEYS[variant.get("base", "adam")]) if projected
               else 1 if o.method in ONE_STATE_METHODS else 2)
    # which matrices the optimizer projects, and on how many directions: its own rule
    group = {"rank": o.rank, "only_scaling": bool(variant.get("only_scaling"))}

    weight_dtype = torch.bfloat16 if weight_bytes == 2 else torch.float32

    def whole(numel: int) -> float:
        """The moments of a parameter stepped whole: torch's optimizers keep them in the
        parameter's dtype (bf16 for bf16 weights), and so does the Fira family at
        state_dtype="float32"."""
        return moments * (numel * weight_bytes if not projected else _stored_bytes(numel, o.state_dtype, weight_dtype))

    states = (1 if m.tie_word_embeddings else 2) * whole(embed) + (2 * layers + 1) * whole(h)
    if o.method == "adam-mini":  # a full first moment, one second moment per block (heads, neurons)
        states, shapes = float(weight_bytes * params), []
    if o.method in PEER_METHODS:  # their own per-matrix states: Flora's fp32, the others' at the weights' dtype
        states = (4 if o.method == "flora" else weight_bytes) * _peer_state_numel(
            o.method, o.rank, shapes, vocab_size, h, layers, tables=1 if m.tie_word_embeddings else 2)
        shapes = []
    matrices = projected_shapes(config)
    for a, b in shapes:
        if (a, b) in matrices:
            r = projected_rank((a, b), group)
            basis, moment = min(a, b) * r, max(a, b) * r  # the low-rank moments: fp32 work dtype
            scalars = 0 if variant.get("residual") == "drop" else 1  # the limiter's ||S_{t-1}||
            basis_dtype = precision.basis_dtype(StateDtype(o.state_dtype), torch.float32)
            states += (basis * basis_dtype.itemsize + moments * _stored_bytes(moment, o.state_dtype, torch.float32)
                       + 4 * scalars)
        else:
            states += whole(a * b)
    s, b = config.data.seq_len, t.micro_batch
    act_bytes = 2 if t.precision in ("bf16", "fp16") or t.param_dtype == "bfloat16" else 4
    per_layer = s * b * h * (34 + 5 * m.num_attention_heads * s / h) * act_bytes / 2
    if t.activation_checkpointing:
        activations = layers * 2 * s * b * h * act_bytes / 2 + per_layer
    else:
        activations = layers * per_layer
    activations += 3 * s * b * vocab_size * 4  # logits, their softmax and gradient, fp32
    chunked = o.state_dtype != "float32" or (o.stochastic_rounding and weight_bytes == 2)
    stepped_whole = largest if o.method in PLAIN_METHODS else embed
    temporaries = (min(stepped_whole, CHUNK) * CHUNK_TEMPORARY_BYTES if chunked
                   else 2 * stepped_whole * weight_bytes)
    if matrices:
        one = max([0] + [_matrix_step_bytes(shape, group, o, variant, weight_bytes) for shape in matrices])
        if device == "cuda" and not o.step_in_backward:
            # a step plans every matrix before it updates one: the terms each keeps from its plan
            # are alive at once (on the CPU they reuse the heap the activations freed)
            one += sum(_planned_bytes(shape, group, o, variant, weight_bytes) for shape in matrices)
        temporaries = max(temporaries, one)
    if device == "cuda" and o.method in FOREACH_METHODS:
        # one foreach step per param group: adamw-grouped's two groups (matrices; the rest) in turn
        temporaries = (max(params - others, others) if o.method == "adamw-grouped" else params) * weight_bytes
    parts = {"weights": params * weight_bytes, "gradients": gradients,
             "optimizer_states": states, "activations": activations,
             "step_temporaries": temporaries}
    total = sum(parts.values())
    if device == "cuda" and not o.step_in_backward:
        # the CUDA allocator counts only live tensors: the activations are freed before the step
        total -= min(activations, temporaries)
    return {**{k: int(v) for k, v in parts.items()}, "total": int(total)}


def projected_shapes(config: "RunConfig") -> list[tuple[int, int]]:
    """The attention and MLP matrices (``(m, n)``, one entry each) that the run's optimizer
    projects, by its own rule (:func:`fira_optim.projection.is_projected`): none for the plain
    methods and the peers (their own per-matrix states), and none for a Fira-family method whose
    ``optim.rank`` is at least every matrix's ``min(m, n)``."""
    m, o = config.model, config.optim
    if o.method in PLAIN_METHODS or o.method in PEER_METHODS:
        return []
    group = {"rank": o.rank, "only_scaling": bool(VARIANTS.get(o.method, {}).get("only_scaling"))}
    return [(a, b) for a, b in llama_matrix_shapes(m.hidden_size, m.intermediate_size, m.num_hidden_layers)
            if is_projected(torch.empty((a, b), device="meta"), group)]


def projects_nothing(config: "RunConfig") -> bool:
    """Whether a method that projects (the Fira family) projects none of the model's matrices at
    ``optim.rank``: it then trains as its plain base optimizer, with full-rank states (the
    optimizer warns when it is built; an estimate builds none)."""
    return config.optim.method not in (*PLAIN_METHODS, *PEER_METHODS) and not projected_shapes(config)


#: fp32 ``m x n`` buffers that the reference path's update of one matrix holds at once
#: (:func:`fira_optim.commit.commit_explicit`: the scaled residual and the update; GaLore and
#: Fira-only-scaling one of them).
EXPLICIT_BUFFERS = 2
#: fp32 ``r x max(m, n)`` buffers of a projected matrix's step: the projected gradient, Adam's
#: direction and one temporary of Adam's.
LOW_RANK_BUFFERS = 3


def _matrix_step_bytes(shape: tuple[int, int], group: dict, o, variant: dict, weight_bytes: int) -> int:
    """Bytes one projected matrix's update allocates on top of its weight, gradient and states:
    the low-rank terms; on the reference path (``optim.implementation=reference``, and FRUGAL's
    sign residual, which has no other) its explicit ``m x n`` terms; for bf16 weights the fp32
    working copy and fp32 gradient (``benchmarks/matrix_step_memory.py`` measures each)."""
    a, b = shape
    r = projected_rank(shape, group)
    buffers = 0
    if _explicit(o, variant):
        buffers = 1 if variant.get("residual") == "drop" or variant.get("only_scaling") else EXPLICIT_BUFFERS
    if weight_bytes == 2:
        buffers += 2
    return 4 * (buffers * a * b + LOW_RANK_BUFFERS * r * max(a, b))


def _planned_bytes(shape: tuple[int, int], group: dict, o, variant: dict, weight_bytes: int) -> int:
    """Bytes one projected matrix holds from the plan of a step to its update, all matrices at
    once (:meth:`fira_optim.Fira.step` plans every matrix first): its fp32 projected gradient
    ``R`` (``r x max(m, n)``), the fp32 copy of a basis stored in bf16 (``state_dtype`` below
    float32), and where the fast path updates fp32 matrices in one batch (fp32 weights and
    states) Adam's direction ``N`` beside ``R``."""
    a, b = shape
    r = projected_rank(shape, group)
    batched = weight_bytes == 4 and o.state_dtype == "float32" and not _explicit(o, variant)
    stored_low = precision.basis_dtype(StateDtype(o.state_dtype), torch.float32) != torch.float32
    return 4 * ((2 if batched else 1) * r * max(a, b) + (min(a, b) * r if stored_low else 0))


def _explicit(o, variant: dict) -> bool:
    """Whether the matrices take the optimizer's reference path: ``optim.implementation=reference``,
    or FRUGAL's sign residual, which the fast path does not cover
    (:meth:`fira_optim.pipeline.FastStrategy.supports`)."""
    return o.implementation == "reference" or variant.get("residual") == Residual.SIGN.value


def _stored_bytes(numel: int, state_dtype: str, work_dtype: torch.dtype) -> int:
    """Bytes of one moment of ``numel`` elements as the optimizer stores it at ``state_dtype``
    (``work_dtype``: the dtype it is computed in): the tensors that
    :func:`fira_optim.precision.moment_zeros` makes for it, built on the meta device (no memory),
    so the estimate follows the optimizer's own rules (int8 only in whole 256-element blocks of
    4096 elements or more, with a fp32 scale per block)."""
    made = precision.moment_zeros((numel,), StateDtype(state_dtype), work_dtype, "meta", "exp_avg")
    return sum(t.numel() * t.element_size() for t in made.values())


def _peer_state_numel(method: str, rank: int, shapes: list[tuple[int, int]], vocab: int, h: int,
                      layers: int, tables: int) -> int:
    """Optimizer-state elements of APOLLO / APOLLO-Mini / Flora / SlimAdam over the whole model:
    the matrices per :func:`fira_train.memory.matrix.footprint_numel`; the embedding and head
    (``vocab x h`` tables) AdamW's two moments for APOLLO, Flora's full momentum and factors
    (a table is too elongated to compress), SlimAdam's first moment and one second moment per
    token; the ``2 layers + 1`` norms Adam's two moments (Flora: and its RMS)."""
    r = 1 if method == "apollo-mini" else None if method == "slimadam" else rank
    matrices = sum(footprint_numel(shape, r, method).optimizer_states for shape in shapes)
    table = {"flora": vocab * h + vocab + h + 1, "slimadam": vocab * h + vocab}.get(method, 2 * vocab * h)
    norms = (2 * layers + 1) * vector_state_numel(h, method)
    return matrices + tables * table + norms
