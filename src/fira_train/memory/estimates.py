r"""The paper's memory estimates (Appendix C.1, GaLore's method) for the LLaMA pre-training sizes.

Every tensor is counted in BF16 (2 bytes an element): weights, gradients and optimizer
states, the three rows of the paper's Table "Comparison of different methods"
(:func:`fira_train.memory.matrix.footprint_numel`). Which tensors each method holds:

* the ``nn.Linear`` weights of attention and MLP
  (:func:`fira_train.memory.matrix.llama_matrix_shapes`) are the matrices a method acts on:
  Fira and GaLore project their gradients at rank ``r``, LoRA/ReLoRA freeze them and train
  rank-``r`` adapters ``B``, ``A`` on every one of them (GaLore: "we apply them to all
  multi-head attention layers and feed-forward layers");
* the token embedding, the untied output head and the RMSNorm weights are trained with
  full-rank Adam by every method (they are never projected, and ReLoRA trains them fully),
  so they cost weights + gradients + ``2 x`` Adam moments in every row.

The architecture is the released ``llama_*.json`` one (vocabulary 32000: the T5 tokenizer's
100 extra ids never occur in C4 and the released configs build a 32000-row embedding; this
gives the 367.97M parameters that GaLore's users count for its released 350M config). The 1B model
has 32 heads and 24 layers as in the released config: the appendix table prints heads 24 and
layers 32, which cannot be right (2048 is not divisible by 24), and only 24 layers reproduce
the paper's "61.1% optimizer-state saving at 1B" (:func:`optimizer_state_saving`).

What reproduces and what does not is in ``docs/results/memory.md``. In short: the paper's
totals are GaLore's Table 2 (weights + optimizer states) plus a gradient term copied from
GaLore's Table 6(a) (:func:`paper_totals_from_galore_tables` reproduces all twelve to the
printed 0.01 G); GaLore's own per-size inputs use nominal sizes (e.g. 2.60 G of weights =
2 bytes x 1.3B for the 1B model, which has 1.339B parameters) and cannot all be recovered from
the architecture, so the architecture-based totals here differ from the printed ones by
-11% to +14% in GB (:data:`PAPER_TOTAL_G` against ``memory_table()``).

The paper's other baselines (:data:`PEER_METHODS`: APOLLO, APOLLO-Mini, Flora, SlimAdam; the
paper prints no memory estimate for them) follow the per-matrix counts of
:mod:`fira_train.memory.matrix`, and what each holds for the embedding, head and norms is what
its optimizer in the harness holds: APOLLO's package gives them AdamW (``2p``); Flora's
optimizer takes every parameter (the tables keep a full momentum -- their aspect ratio is above
4 -- with Adafactor's factored second moment; norms ``2d + 1``); SlimAdam averages the second
moment of the embedding and head over the width (a vector per token) and keeps norms in full.
Ranks (:func:`default_rank`): APOLLO and Flora at the table's rank (APOLLO's README: rank "1/4
of the original dim ... (same as Galore)", which is what ``fira-train pretrain --recipe 60m``
... ``1b`` run; at 7B the README's 256), APOLLO-Mini at 1, SlimAdam has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fira_train.memory.matrix import PEER_METHODS, footprint_numel, llama_matrix_shapes, vector_state_numel

#: Bytes in one "G" of the tables. GaLore's worked example (60M, LoRA r=128: 42.7M + 60M
#: parameters -> 0.20G of weights, 42.7M x 2 states -> 0.17G) uses 10**9.
UNITS: dict[str, int] = {"GB": 10**9, "GiB": 2**30}
BYTES_PER_ELEMENT: dict[str, int] = {"bf16": 2, "fp32": 4}

#: Methods of the paper's Table 2 (``relora`` holds the same tensors as ``lora``).
TABLE_METHODS = ("full", "fira", "galore", "lora", "relora")
METHOD_LABELS = {
    "full": "Full-rank Adam",
    "adam": "Full-rank Adam",
    "fira": "Fira",
    "galore": "GaLore",
    "lora": "LoRA",
    "relora": "ReLoRA",
    "apollo": "APOLLO",
    "apollo-mini": "APOLLO-Mini",
    "flora": "Flora",
    "slimadam": "SlimAdam",
}
# Per-matrix accounting used by each table method (fira_train.memory.matrix.METHODS).
_MATRIX_METHOD = {"full": "adam", "adam": "adam", "fira": "fira", "galore": "galore",
                  "lora": "lora", "relora": "lora", **{m: m for m in PEER_METHODS}}
#: Methods without a rank (their ``rank`` column is empty).
_RANKLESS = ("full", "adam", "slimadam")


@dataclass(frozen=True)
class LlamaSize:
    """A LLaMA decoder (RMSNorm, SwiGLU, no bias, no grouped KV) as in the released configs."""

    name: str
    hidden: int
    """Model width ``d_model`` (``hidden_size``)."""
    intermediate: int
    """SwiGLU width (``intermediate_size``)."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    layers: int
    """Decoder layers (``num_hidden_layers``)."""
    vocab: int = 32000
    """Embedding rows (``vocab_size``)."""
    tie_embeddings: bool = False
    """Whether the output head shares the embedding matrix (it does not in the paper)."""

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "heads", "layers", "vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {field}={value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"heads must divide hidden, got hidden={self.hidden}, heads={self.heads}"
            )

    def matrix_shapes(self) -> list[tuple[int, int]]:
        """Shapes of the attention and MLP ``nn.Linear`` weights (the projected matrices)."""
        return llama_matrix_shapes(self.hidden, self.intermediate, self.layers)

    @property
    def unprojected_numel(self) -> int:
        """Embedding, output head (unless tied) and the ``2 L + 1`` RMSNorm weights."""
        tables = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return tables + (2 * self.layers + 1) * self.hidden

    @property
    def numel(self) -> int:
        """All parameters of ``LlamaForCausalLM`` built from this config."""
        return self.unprojected_numel + sum(m * n for m, n in self.matrix_shapes())


#: The paper's pre-training sizes (Appendix B / GaLore's released ``configs/llama_*.json``).
LLAMA_SIZES: dict[str, LlamaSize] = {
    "60M": LlamaSize("60M", hidden=512, intermediate=1376, heads=8, layers=8),
    "130M": LlamaSize("130M", hidden=768, intermediate=2048, heads=12, layers=12),
    "350M": LlamaSize("350M", hidden=1024, intermediate=2736, heads=16, layers=24),
    "1B": LlamaSize("1B", hidden=2048, intermediate=5461, heads=32, layers=24),
    "7B": LlamaSize("7B", hidden=4096, intermediate=11008, heads=32, layers=32),
}

#: Rank per size in the paper's Table 2 (same r for every low-rank method), and at 7B the
#: released Fira script's rank 64 (``scripts/llama_7b.sh``).
PAPER_RANKS: dict[str, int] = {"60M": 128, "130M": 256, "350M": 256, "1B": 512, "7B": 64}
#: GaLore's rank at 7B implied by "Fira uses an 8x smaller rank" (64 x 8). GaLore's own 7B
#: run used r = 1024.
GALORE_7B_RANK = 512
#: APOLLO's rank at 7B: apollo-torch's README, "256 for APOLLO works well for 1B and 7B model".
APOLLO_7B_RANK = 256

#: Totals printed in the paper's Table 2 (params + grads + optimizer states, "G").
PAPER_TOTAL_G: dict[tuple[str, str], float] = {
    **{(s, "full"): v for s, v in zip(("60M", "130M", "350M", "1B"), (0.48, 1.01, 2.74, 10.40))},
    **{(s, "fira"): v for s, v in zip(("60M", "130M", "350M", "1B"), (0.36, 0.77, 1.90, 6.98))},
    **{(s, "galore"): v for s, v in zip(("60M", "130M", "350M", "1B"), (0.36, 0.77, 1.90, 6.98))},
    **{(s, "lora"): v for s, v in zip(("60M", "130M", "350M", "1B"), (0.44, 0.99, 2.12, 7.36))},
    **{(s, "relora"): v for s, v in zip(("60M", "130M", "350M", "1B"), (0.44, 0.99, 2.12, 7.36))},
}

_SIZES4 = ("60M", "130M", "350M", "1B")
#: GaLore (Zhao et al., ICML 2024) Table 2: weights + optimizer states, "G".
GALORE_TABLE2_G: dict[tuple[str, str], float] = {
    **{(s, "full"): v for s, v in zip(_SIZES4, (0.36, 0.76, 2.06, 7.80))},
    **{(s, "galore"): v for s, v in zip(_SIZES4, (0.24, 0.52, 1.22, 4.38))},
    **{(s, "lora"): v for s, v in zip(_SIZES4, (0.36, 0.80, 1.76, 6.17))},
}
#: GaLore Table 6(a), memory of weight parameters, "G": ``full`` (= GaLore's row) and
#: ``low-rank`` (the trainable parameters of a rank-r factorisation: LoRA's adapters plus the
#: embeddings, head and norms).
GALORE_TABLE6A_G: dict[tuple[str, str], float] = {
    **{(s, "full"): v for s, v in zip(_SIZES4, (0.12, 0.25, 0.68, 2.60))},
    **{(s, "low-rank"): v for s, v in zip(_SIZES4, (0.08, 0.18, 0.36, 1.19))},
}


def _size(size: str | LlamaSize) -> LlamaSize:
    if isinstance(size, LlamaSize):
        return size
    if size not in LLAMA_SIZES:
        raise ValueError(f"size must be one of {tuple(LLAMA_SIZES)} or a LlamaSize, got size={size!r}")
    return LLAMA_SIZES[size]


def _method(method: str) -> str:
    if method not in _MATRIX_METHOD:
        raise ValueError(f"method must be one of {tuple(_MATRIX_METHOD)}, got method={method!r}")
    return method


def default_rank(size: str | LlamaSize, method: str) -> int | None:
    """The rank the paper uses for ``method`` at ``size`` (``None`` for full-rank Adam).

    Table 2's rank for every low-rank method at 60M-1B; at 7B, Fira's 64 and GaLore's
    :data:`GALORE_7B_RANK` (LoRA/ReLoRA were not run at 7B: shown at Fira's rank). APOLLO takes
    the same ranks except :data:`APOLLO_7B_RANK` at 7B, APOLLO-Mini 1, Flora the table's (at 7B
    Fira's, like LoRA); full-rank Adam and SlimAdam have none.
    """
    spec = _size(size)
    method = _method(method)
    if method in _RANKLESS:
        return None
    if method == "apollo-mini":
        return 1
    if spec.name == "7B" and method == "galore":
        return GALORE_7B_RANK
    if spec.name == "7B" and method == "apollo":
        return APOLLO_7B_RANK
    if spec.name not in PAPER_RANKS:
        raise ValueError(f"no paper rank for size={spec.name!r}; pass ranks explicitly")
    return PAPER_RANKS[spec.name]


def _rank_for(spec: LlamaSize, method: str, ranks: Mapping[str, int] | None) -> int | None:
    if ranks and method in ranks:
        return ranks[method]
    return default_rank(spec, method)


@dataclass(frozen=True)
class ModelFootprint:
    """Elements a whole model costs under one method."""

    weights: int
    gradients: int
    optimizer_states: int
    projected_states: int
    """The part of ``optimizer_states`` held for the attention/MLP matrices."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states


def model_footprint(size: str | LlamaSize, method: str, rank: int | None = None) -> ModelFootprint:
    """Weights, gradients and optimizer states (elements) of a LLaMA model under ``method``.

    Attention/MLP matrices follow the paper's per-matrix table
    (:func:`fira_train.memory.matrix.footprint_numel`); embeddings, head and norms cost
    ``p`` weights, ``p`` gradients and ``2p`` Adam moments under every method but Flora and
    SlimAdam (:func:`_unprojected_states`). ``rank`` defaults to :func:`default_rank`.
    """
    spec = _size(size)
    method = _method(method)
    if rank is None:
        rank = default_rank(spec, method)
    matrix_method = _MATRIX_METHOD[method]
    weights = gradients = states = 0
    for shape in spec.matrix_shapes():
        fp = footprint_numel(shape, rank, matrix_method)
        weights += fp.weights
        gradients += fp.gradients
        states += fp.optimizer_states
    rest = spec.unprojected_numel
    return ModelFootprint(
        weights=weights + rest,
        gradients=gradients + rest,
        optimizer_states=states + _unprojected_states(spec, matrix_method, rank),
        projected_states=states,
    )


def _unprojected_states(spec: LlamaSize, matrix_method: str, rank: int | None) -> int:
    """Optimizer states of the embedding, head and norms: Adam's ``2p``, except under the two
    methods whose optimizer also takes them differently (Flora's, SlimAdam's)."""
    if matrix_method not in ("flora", "slimadam"):
        return 2 * spec.unprojected_numel
    table = (spec.vocab, spec.hidden)  # SlimAdam averages both over the width: dimension 1
    tables = (1 if spec.tie_embeddings else 2) * footprint_numel(table, rank, matrix_method,
                                                                 compressed_dim=1).optimizer_states
    return tables + (2 * spec.layers + 1) * vector_state_numel(spec.hidden, matrix_method)


def memory_table(
    sizes: Iterable[str | LlamaSize] = tuple(LLAMA_SIZES),
    methods: Iterable[str] = (*TABLE_METHODS, *PEER_METHODS),
    *,
    ranks: Mapping[str, int] | None = None,
    dtype: str = "bf16",
) -> list[dict[str, Any]]:
    """One row per (size, method): elements, bytes and totals in GB and GiB, with the paper's value.

    Args:
        sizes: names in :data:`LLAMA_SIZES` or :class:`LlamaSize` objects.
        methods: names in :data:`TABLE_METHODS` and :data:`PEER_METHODS` (the default: all of
            them; ``"adam"`` is accepted for ``"full"``).
        ranks: optional ``{method: rank}`` overriding :func:`default_rank` for every size.
        dtype: bytes per element for all three terms (``"bf16"``, the paper's, or ``"fp32"``).

    Row keys: ``size``, ``method``, ``rank``, ``params``, ``weights``, ``gradients``,
    ``optimizer_states`` (elements), ``bytes``, ``GB``, ``GiB``, ``paper_G`` (``None`` where the
    paper prints nothing) and ``diff_G`` (``GB - paper_G``).
    """
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {tuple(BYTES_PER_ELEMENT)}, got dtype={dtype!r}")
    width = BYTES_PER_ELEMENT[dtype]
    methods = [_method(m) for m in methods]
    rows = []
    for size in sizes:
        spec = _size(size)
        for method in methods:
            rank = _rank_for(spec, method, ranks)
            fp = model_footprint(spec, method, rank)
            total = fp.total * width
            paper = PAPER_TOTAL_G.get((spec.name, "full" if method == "adam" else method))
            rows.append({
                "size": spec.name,
                "method": method,
                "rank": None if method in _RANKLESS else rank,
                "params": spec.numel,
                "weights": fp.weights,
                "gradients": fp.gradients,
                "optimizer_states": fp.optimizer_states,
                "bytes": total,
                "GB": total / UNITS["GB"],
                "GiB": total / UNITS["GiB"],
                "paper_G": paper,
                "diff_G": None if paper is None else total / UNITS["GB"] - paper,
            })
    return rows


def _millions(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def format_memory_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of :func:`memory_table` rows (elements in millions, totals in G)."""
    header = ("| Model | Method | r | Weights (M) | Grads (M) | Opt. states (M) "
              "| Total GB (1e9) | Total GiB | Paper (G) | GB - paper |")
    lines = [header, "|" + "---|" * 10]
    for row in rows:
        paper = "" if row["paper_G"] is None else f"{row['paper_G']:.2f}"
        diff = "" if row["diff_G"] is None else f"{row['diff_G']:+.2f}"
        rank = "" if row["rank"] is None else str(row["rank"])
        lines.append(
            f"| {row['size']} | {METHOD_LABELS[row['method']]} | {rank} "
            f"| {_millions(row['weights'])} | {_millions(row['gradients'])} "
            f"| {_millions(row['optimizer_states'])} | {row['GB']:.2f} | {row['GiB']:.2f} "
            f"| {paper} | {diff} |"
        )
    return "\n".join(lines)


def paper_totals_from_galore_tables() -> dict[tuple[str, str], float]:
    """The paper's Table 2 totals rebuilt from GaLore's published tables.

    ``total = GaLore Table 2 (weights + optimizer states) + gradients``, the gradient term
    being GaLore's Table 6(a) weight memory of the trainable parameters: the ``full`` row for
    full-rank, GaLore and Fira (whose gradients are ``m n``), the ``low-rank`` row for
    LoRA/ReLoRA (gradients only for the adapters, embeddings, head and norms). Fira's extra
    ``+1`` scalar per matrix does not show at 0.01 G, so Fira equals GaLore.
    """
    out: dict[tuple[str, str], float] = {}
    for size in _SIZES4:
        full_grads = GALORE_TABLE6A_G[(size, "full")]
        out[(size, "full")] = GALORE_TABLE2_G[(size, "full")] + full_grads
        out[(size, "galore")] = GALORE_TABLE2_G[(size, "galore")] + full_grads
        out[(size, "fira")] = out[(size, "galore")]
        lora = GALORE_TABLE2_G[(size, "lora")] + GALORE_TABLE6A_G[(size, "low-rank")]
        out[(size, "lora")] = out[(size, "relora")] = lora
    return out


def optimizer_state_saving(size: str | LlamaSize, method: str = "fira", rank: int | None = None) -> float:
    """Fraction of full-rank Adam's optimizer-state memory that ``method`` saves
    (the paper: "Fira saves 61.1% ... of the optimizer states ... LLaMA 1B")."""
    adam = model_footprint(size, "full").optimizer_states
    return 1.0 - model_footprint(size, method, rank).optimizer_states / adam


def optimizer_state_bytes_table(
    sizes: Iterable[str | LlamaSize] = tuple(LLAMA_SIZES),
    methods: Iterable[str] = ("adam", "galore", "fira"),
    *,
    ranks: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer-state elements and bytes (fp32 and bf16 states) per size and method.

    Row keys: ``size``, ``method``, ``rank``, ``projected_states`` (elements held for the
    attention/MLP matrices), ``other_states`` (Adam on embeddings, head, norms),
    ``states`` (their sum), ``fp32_bytes``, ``bf16_bytes``, ``vs_adam`` (``states`` over
    Adam's) and ``projected_vs_adam`` (the same for the projected matrices alone).
    """
    methods = [_method(m) for m in methods]
    rows = []
    for size in sizes:
        spec = _size(size)
        adam = model_footprint(spec, "adam")
        for method in methods:
            rank = _rank_for(spec, method, ranks)
            fp = model_footprint(spec, method, rank)
            rows.append({
                "size": spec.name,
                "method": method,
                "rank": None if method in _RANKLESS else rank,
                "projected_states": fp.projected_states,
                "other_states": fp.optimizer_states - fp.projected_states,
                "states": fp.optimizer_states,
                "fp32_bytes": fp.optimizer_states * BYTES_PER_ELEMENT["fp32"],
                "bf16_bytes": fp.optimizer_states * BYTES_PER_ELEMENT["bf16"],
                "vs_adam": fp.optimizer_states / adam.optimizer_states,
                "projected_vs_adam": fp.projected_states / adam.projected_states,
            })
    return rows


def format_optimizer_state_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of :func:`optimizer_state_bytes_table` rows."""
    header = ("| Model | Method | r | Projected states (M) | Other states (M) | Total (M) "
              "| fp32 GB | bf16 GB | vs Adam | projected vs Adam |")
    lines = [header, "|" + "---|" * 10]
    for row in rows:
        rank = "" if row["rank"] is None else str(row["rank"])
        lines.append(
            f"| {row['size']} | {METHOD_LABELS[row['method']]} | {rank} "
            f"| {_millions(row['projected_states'])} | {_millions(row['other_states'])} "
            f"| {_millions(row['states'])} | {row['fp32_bytes'] / 1e9:.3f} "
            f"| {row['bf16_bytes'] / 1e9:.3f} | {row['vs_adam']:.3f} "
            f"| {row['projected_vs_adam']:.4f} |"
        )
    return "\n".join(lines)


__all__ = [
    "APOLLO_7B_RANK",
    "BYTES_PER_ELEMENT",
    "GALORE_7B_RANK",
    "GALORE_TABLE2_G",
    "GALORE_TABLE6A_G",
    "LLAMA_SIZES",
    "LlamaSize",
    "ModelFootprint",
    "PAPER_RANKS",
    "PAPER_TOTAL_G",
    "PEER_METHODS",
    "TABLE_METHODS",
    "UNITS",
    "default_rank",
    "format_memory_table",
    "format_optimizer_state_table",
    "memory_table",
    "model_footprint",
    "optimizer_state_bytes_table",
    "optimizer_state_saving",
    "paper_totals_from_galore_tables",
]
