"""Method specs: ``NAME[@key=value...]``, a method of the registry with overrides of its own.

``fira@optim.step_in_backward=true@optim.state_dtype=int8`` is Fira with two config overrides
(the ``key=value`` overrides of :mod:`fira_train.config.overrides`). Commands that take
``--methods`` (``compare``, ``memory --measure``, ...) take a comma-separated list of specs; the
spec as written labels its row and names its run folder. A value cannot hold a comma or ``@``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fira_train.config.comma_list import comma_list
from fira_train.config.overrides import apply_overrides, flat_config, override_key, refuse_overrides
from fira_train.config.resolve import resolved
from fira_train.config.run_config import RunConfig
from fira_train.methods.registry import get_method


#: What a command that takes ``--methods`` sets for each spec's run itself: an override of one
#: would be silently replaced.
SPEC_SETS = ("optim.method", "train.out_dir")


@dataclass(frozen=True)
class MethodSpec:
    """One entry of ``--methods``."""

    text: str
    """The spec as written: the row label and the run folder's name."""
    name: str
    """The registry method (``optim.method``)."""
    overrides: tuple[str, ...] = ()
    """``key=value`` overrides applied on top of the command's config, in order."""

    def setting(self, key: str) -> str | None:
        """The value text this spec gives ``key`` (``"4"`` for ``@train.micro_batch_size=4``), or
        None where it does not set it (a spec sets a key once)."""
        return next((item.partition("=")[2].strip() for item in self.overrides if override_key(item) == key), None)

    def config(self, base: RunConfig, out_dir: str | Path) -> RunConfig:
        """``base`` for this method, writing to ``out_dir/<text>``."""
        config = replace(base, optim=replace(base.optim, method=self.name))
        if self.overrides:
            try:
                config = apply_overrides(config, list(self.overrides))
            except ValueError as err:  # which of several specs holds the value the message names
                raise ValueError(f"method spec {self.text!r}: {err}") from None
        return replace(config, train=replace(config.train, out_dir=str(Path(out_dir) / self.text)))


def parse_method_spec(text: str) -> MethodSpec:
    """``"NAME@key=value@..."`` -> :class:`MethodSpec` (ValueError naming the spec)."""
    text = text.strip()
    name, *overrides = text.split("@")
    if not name:
        raise ValueError(f"method spec {text!r} names no method (expected NAME[@key=value...])")
    keys = set()
    for override in overrides:
        key = override_key(override)
        if "=" not in override or not key:
            raise ValueError(f"method spec {text!r}: {override!r} is not a key=value override")
        if key == "optim.method":
            raise ValueError(f"method spec {text!r}: the method is {name!r}; do not override optim.method")
        if key == "train.out_dir":
            raise ValueError(f"method spec {text!r}: its run's folder is OUT/<spec>; do not override train.out_dir")
        if key in keys:  # one would silently replace the other
            raise ValueError(f"method spec {text!r} sets {key} twice")
        keys.add(key)
    if "/" in text or text in (".", ".."):
        raise ValueError(f"method spec {text!r} cannot name a run folder (no '/')")
    return MethodSpec(text, name, tuple(overrides))


def refuse_set_per_spec(overrides: list[str], command: str) -> None:
    """ValueError for a command-wide override of a key each spec's run sets (:data:`SPEC_SETS`)."""
    refuse_overrides(overrides, SPEC_SETS, f"{command} sets it for each method spec (--methods, --out)")


#: What every run of a comparison shares, so that its methods differ in nothing else (the same
#: data, tokens and seed): ``compare`` and ``sweep`` refuse a spec that changes one. A key ending
#: in ``.`` stands for its whole section.
SHARED = ("train.steps", "train.batch_size", "train.seed", "data.")


def refuse_spec_keys(specs: Sequence[MethodSpec], keys: Sequence[str], why: str) -> None:
    """ValueError for a spec that overrides one of ``keys`` (``why``: what the command does with
    it instead)."""
    for spec in specs:
        for override in spec.overrides:
            key = override_key(override)
            if any(key == k or k.endswith(".") and key.startswith(k) for k in keys):
                raise ValueError(f"method spec {spec.text!r} sets {key}: {why}")


def parse_method_specs(text: str) -> list[MethodSpec]:
    """A comma-separated list of specs: at least one, none twice, none empty, each naming a
    method of the registry (ValueError listing the valid names)."""
    specs = [parse_method_spec(part) for part in comma_list(text, "--methods")]
    for before, spec in zip([None, *specs], specs):
        if before is not None and before.overrides and not spec.overrides and not spec.name[:1].isalpha():
            # "fira@optim.betas=0.9,0.95": the list was cut inside a value, not at a method
            key = override_key(before.overrides[-1])
            raise ValueError(f"--methods: {spec.text!r}, after {before.text!r}, is no method: a comma separates "
                             f"method specs, so a spec's value cannot hold one; set {key} for all of them "
                             f"with the key=value override {key}=...")
        get_method(spec.name)
    return specs


def refuse_same_runs(specs: Sequence[MethodSpec], base: RunConfig) -> None:
    """ValueError naming two specs that train the same run on ``base``: the same method with the
    same settings, however written (``fira@optim.rank=4`` and ``fira@optim.rank=04``, the same
    overrides in another order, an override of the value ``base`` has, or of an ``optim`` setting
    the method does not read, or of the value a default resolves to: ``fira@optim.lr=0.01`` where
    0.01 is the recipe's tuned rate for ``fira``). Refused, not merged: each spec as written labels its row and names
    its folder (and a sweep's ``--lrs SPEC:...``), so dropping one would lose what it names."""
    seen: dict[str, MethodSpec] = {}
    for spec in specs:
        resolved = _resolved(spec, base)
        if resolved in seen:
            raise ValueError(f"--methods: {seen[resolved].text!r} and {spec.text!r} are the same run (the same "
                             "method and settings) written two ways; give one of them")
        seen[resolved] = spec


def _resolved(spec: MethodSpec, base: RunConfig) -> str:
    """What a spec's run depends on: its config on ``base`` with its defaults resolved (the
    learning rate, the sign alignment: :func:`~fira_train.config.resolve.resolved`), without its
    folder and without the ``optim`` settings its method does not read, as text (values may be
    lists)."""
    method = get_method(spec.name)
    flat = flat_config(resolved(spec.config(base, ".")))
    kept = {key: value for key, value in flat.items() if key != "train.out_dir" and method.reads(key)}
    return repr(sorted(kept.items()))
