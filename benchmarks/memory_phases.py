"""Where a training step's peak memory is made: the peak resident set of each phase of each
step (forward, backward, optimizer step), each method in a fresh process, on the CPU.

``fira-train memory --measure`` gives one number per method, the run's peak; this script splits
it. For every step and phase it records the resident set at the phase's start and the phase's
own peak (Linux ``VmHWM``, reset at the start of each phase), both minus the resident set before
the model was built (the same baseline as ``memory --measure``), and beside them the exact bytes
of what is alive: the weights, the gradients, the optimizer's states and the tensors the forward
pass saved for the backward pass (counted by ``torch.autograd.graph.saved_tensors_hooks``, each
storage once). "Transient" is a phase's peak minus its start: what the phase allocated and freed
again (activations, the step's temporaries, the SVDs of a refresh, the allocator's growth).

Usage (one sequence of 256 tokens, as in docs/results/memory-measured)::

    python benchmarks/memory_phases.py --recipe 60m --steps 3 \
        --methods adamw,fira,fira@optim.step_in_backward=true \
        --out docs/results/memory-measured/phases-60m train.batch_size=1 train.micro_batch_size=1

Writes ``OUT/phases.json`` and ``OUT/phases.md``. glibc's ``MALLOC_*`` environment variables
(e.g. ``MALLOC_MMAP_THRESHOLD_=131072``: every allocation from 128 KiB up is mapped on its own and
returned when freed) are recorded with the command: they decide how much freed memory stays
resident.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from fira_optim.state import optimizer_state_bytes
from fira_train.config.method_spec import parse_method_specs
from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import get_recipe
from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus
from fira_train.files import write_text_atomic
from fira_train.memory.run_estimate import estimate_run_bytes, is_estimated
from fira_train.measure import build_measured
from fira_train.run.isolated import run_isolated
from fira_train.run.peak_memory import current_rss_bytes, env_prefix, malloc_env, reset_rss_peak, rss_peak_bytes
from fira_train.run.training import autocast_for

MIB = 2**20


def _tensor_bytes(tensors, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct CPU storages behind ``tensors``, but for those in ``exclude``."""
    seen, total = set(exclude), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class _Phase:
    """The resident set at a phase's start and its peak, both minus ``baseline``."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline

    @contextlib.contextmanager
    def __call__(self, record: dict[str, Any]):
        gc.collect()
        record["start"] = (current_rss_bytes() or 0) - self.baseline
        reset_rss_peak()
        yield
        record["peak"] = (rss_peak_bytes() or 0) - self.baseline
        record["end"] = (current_rss_bytes() or 0) - self.baseline


def measure_phases(config: RunConfig, steps: int) -> dict[str, Any]:
    """``steps`` training steps of ``config`` (one micro-batch each), phase by phase; run it in
    a fresh process (:func:`fira_train.run.isolated.run_isolated`)."""
    corpus, _, baseline, training = build_measured(config)  # on the CPU: main() sets train.device
    built = (rss_peak_bytes() or 0) - baseline
    model, optimizer = training.model, training.optimizer
    stream = corpus.train_batches(config.train.micro_batch,
                                  config.train.seed)
    autocast = autocast_for(config, training.device)
    phase = _Phase(baseline)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    records = []
    for step in range(1, steps + 1):
        ids = next(stream)
        saved: list[torch.Tensor] = []
        fwd, bwd, opt = {}, {}, {}
        with phase(fwd):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                with autocast:
                    loss = model(input_ids=ids, labels=ids).loss
        # the weights a layer saves for its backward are the parameters: not counted twice
        fwd["saved_for_backward"] = _tensor_bytes(saved, weights)
        saved.clear()
        with phase(bwd):
            training.scale(loss).backward()  # train.precision=fp16: scaled, as fira-train does
        bwd["gradients_after"] = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        with phase(opt):
            if training.grad_scaler is not None:
                training.grad_scaler.step(optimizer)
                training.grad_scaler.update()
            else:
                optimizer.step()
            training.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        opt["states_after"] = optimizer_state_bytes(optimizer)
        records.append({"step": step, "loss": loss.item(), "forward": fwd, "backward": bwd,
                        "optimizer_step": opt})
        del loss
    return {"baseline_bytes": baseline, "built_peak_bytes": built,
            "weights_bytes": _tensor_bytes(model.parameters()),
            "optimizer_state_bytes": optimizer_state_bytes(optimizer),
            "vocab_size": corpus.vocab_size, "steps": records}


def format_phases(record: dict[str, Any]) -> str:
    lines = [f"# Peak memory by phase: recipe `{record['recipe']}`, {record['steps']} steps", "",
             f"{record['machine']}, {record['date']}. All in MiB, minus the resident set before "
             "the model was built. Start / peak / end: the resident set at the phase's start, its "
             "peak during the phase, at its end; transient = peak - start.", ""]
    for row in record["rows"]:
        m = row["measured"]
        est = row["estimate"]
        lines += [f"## {row['method']}", "",
                  f"Weights {m['weights_bytes'] / MIB:.0f}, optimizer states "
                  f"{m['optimizer_state_bytes'] / MIB:.0f}; model and optimizer built at peak "
                  f"{m['built_peak_bytes'] / MIB:.0f}. Estimate (`run_estimate`): "
                  + ", ".join(f"{k} {v / MIB:.0f}" for k, v in est.items()) + ".", "",
                  "| step | phase | start | peak | end | transient | alive (exact) |",
                  "|---|---|---|---|---|---|---|"]
        run_peak = 0
        for s in m["steps"]:
            for name, key, alive in (
                    ("forward", "forward", f"saved for backward {s['forward']['saved_for_backward'] / MIB:.0f}"),
                    ("backward", "backward", f"gradients after {s['backward']['gradients_after'] / MIB:.0f}"),
                    ("optimizer step", "optimizer_step", f"states after {s['optimizer_step']['states_after'] / MIB:.0f}")):
                p = s[key]
                run_peak = max(run_peak, p["peak"])
                lines.append(f"| {s['step']} | {name} | {p['start'] / MIB:.0f} | {p['peak'] / MIB:.0f} "
                             f"| {p['end'] / MIB:.0f} | {(p['peak'] - p['start']) / MIB:.0f} | {alive} |")
        lines += ["", f"Peak of the steps: {run_peak / MIB:.0f} MiB; estimated total "
                  f"{est['total'] / MIB:.0f} MiB.", ""]
    lines += ["Command:", "", "```bash", env_prefix(record.get("malloc_env", {})) + record["command"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--methods", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    config = apply_overrides(get_recipe(args.recipe), args.overrides)
    config = replace(config, train=replace(config.train, steps=args.steps, progress=False,
                                           tensorboard=False, device="cpu"))
    specs = parse_method_specs(args.methods)
    unmodelled = [spec.text for spec in specs if not is_estimated(spec.name)]
    if unmodelled:  # before anything is measured: each row compares with the estimate
        parser.error(f"--methods: the run estimate does not model {', '.join(unmodelled)}")
    build_corpus(config.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"recipe": args.recipe, "steps": args.steps,
              "command": "python benchmarks/memory_phases.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              # glibc's allocator settings change how much freed memory stays resident
              "malloc_env": malloc_env(),
              "rows": []}
    for spec in specs:
        run_config = spec.config(config, out / "runs")
        measured = run_isolated(measure_phases, run_config, args.steps)
        estimate = estimate_run_bytes(run_config, measured["vocab_size"])
        record["rows"].append({"method": spec.text, "measured": measured, "estimate": estimate})
        print(f"{spec.text}: done", flush=True)
        write_text_atomic(out / "phases.json", json.dumps(record, indent=1) + "\n")
        write_text_atomic(out / "phases.md", format_phases(record))
    print(out / "phases.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
