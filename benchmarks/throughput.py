"""Training throughput of several methods side by side on one recipe (the target: Fira at >= 97% of AdamW).

    python benchmarks/throughput.py --recipe tiny --methods adamw,fira,galore --rounds 6 \
        --out docs/benchmarks/throughput_tiny.json

``--methods`` entries may carry their own overrides: ``fira@optim.projector=randomized``.

Every method gets its own model, optimizer and schedule, built by the harness exactly as
`fira-train pretrain` builds them, on the same batches. The methods then take turns: in each
round every method runs one refresh period (``T`` steps of the recipe, so every Fira/GaLore
round contains exactly one projection refresh) and is timed over it. Interleaving makes
machine-load drift hit every method alike; the ratio is taken per round and the median
reported. A step is forward + backward (with gradient accumulation), clipping, optimizer
and scheduler: what `fira-train` times for tokens/s. On a machine whose speed drifts (a shared
2-core VM), the round ratios scatter by several percent; the script therefore also times the
part after the backward passes (clipping, optimizer, schedule) on its own and reports
``ratio_to_adamw_pooled`` = (F + O_adamw) / (F + O_method), F the median forward + backward time
of a round pooled over all methods, O each method's median optimizer time per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import get_recipe
from fira_train.data.build import build_corpus
from fira_train.run.train import train_step
from fira_train.run.training import autocast_for, build_training, resolve_device
from record import machine, provenance, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--methods", default="adamw,fira,galore")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per method first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the recipe's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every method")
    args = parser.parse_args()
    # An entry is a method name, optionally with its own overrides: fira@optim.projector=randomized
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or "adamw" not in methods:
        parser.error(f"--methods {args.methods!r}: list at least adamw (the reference) and one other")
    base = apply_overrides(get_recipe(args.recipe), list(args.overrides))
    if args.threads:
        torch.set_num_threads(args.threads)
    elif base.train.num_threads:
        torch.set_num_threads(base.train.num_threads)
    corpus = build_corpus(base.data)
    runs = {}
    for method in methods:
        name, *extra = method.split("@")
        config = apply_overrides(base, [f"optim.method={name}", *extra])
        device = resolve_device(config)
        training = build_training(config, corpus.vocab_size, device)
        micro = config.train.micro_batch
        runs[method] = dict(config=config, training=training, device=device,
                            autocast=autocast_for(config, device),
                            stream=corpus.train_batches(micro, config.train.seed), step=0)
    period = base.optim.update_proj_gap
    tokens_per_step = base.train.batch_size * base.data.seq_len

    def step(run) -> float:
        """One training step as `fira-train` runs it (:func:`fira_train.run.train.train_step`);
        returns the seconds spent after the backward passes (clipping, optimizer, schedule):
        the part that differs between methods."""
        run["step"] += 1
        _, update_seconds = train_step(run["training"], run["config"], run["stream"], run["autocast"],
                                       run["step"])
        return update_seconds

    for method in methods:
        for _ in range(args.warmup_steps):
            step(runs[method])
    seconds = {m: [] for m in methods}
    optimizer_seconds = {m: [] for m in methods}
    step_seconds = {m: [] for m in methods}  # per round: the update seconds of each step
    for r in range(args.rounds):
        for method in methods:
            start = time.perf_counter()
            steps = [step(runs[method]) for _ in range(period)]
            seconds[method].append(time.perf_counter() - start)
            optimizer_seconds[method].append(sum(steps))
            step_seconds[method].append(steps)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} {tokens_per_step * period / seconds[m][-1]:.0f} tok/s" for m in methods), flush=True)
    ratios = {m: [a / b for a, b in zip(seconds["adamw"], seconds[m])] for m in methods}
    # Less noisy: the forward and backward passes are the same computation for every method, so
    # pool their time over all methods and rounds, and add each method's own median optimizer
    # time per period. Load drift then moves the common part, not the comparison.
    forward_backward = statistics.median(
        t - o for m in methods for t, o in zip(seconds[m], optimizer_seconds[m]))
    optimizer_median = {m: statistics.median(v) for m, v in optimizer_seconds.items()}
    pooled = {m: (forward_backward + optimizer_median["adamw"]) / (forward_backward + optimizer_median[m])
              for m in methods}
    # The same estimate round by round (each round's forward + backward pooled over its
    # methods, each method's own optimizer time in that round): its spread says how far the
    # pooled ratio can be trusted.
    pooled_rounds = {m: [] for m in methods}
    for r in range(args.rounds):
        common = statistics.median(seconds[m][r] - optimizer_seconds[m][r] for m in methods)
        for m in methods:
            pooled_rounds[m].append((common + optimizer_seconds["adamw"][r]) / (common + optimizer_seconds[m][r]))
    # The slowest step of a round is the one that refreshes the projections (one per round for
    # the Fira/GaLore family); the others are steady steps.
    refresh_step = {m: statistics.median(max(r) for r in v) for m, v in step_seconds.items()}
    steady_step = {m: statistics.median(t for r in v for t in sorted(r)[:-1]) for m, v in step_seconds.items()}
    result = {
        **provenance(),
        "machine": machine(f"{torch.get_num_threads()} threads"),
        "recipe": args.recipe,
        "rank": base.optim.rank,
        "update_proj_gap": base.optim.update_proj_gap,
        "steps_per_round": period,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s_median": {m: tokens_per_step * period / statistics.median(v) for m, v in seconds.items()},
        "ratio_to_adamw_median": {m: statistics.median(v) for m, v in ratios.items()},
        "ratio_to_adamw_per_round": ratios,
        "round_seconds": seconds,
        "optimizer_seconds_per_round_median": optimizer_median,
        "forward_backward_seconds_per_round_median": forward_backward,
        "ratio_to_adamw_pooled": pooled,
        "ratio_to_adamw_pooled_per_round": pooled_rounds,
        "update_seconds_per_step": step_seconds,
        "slowest_step_seconds_median": refresh_step,
        "other_steps_seconds_median": steady_step,
    }
    print(json.dumps({k: result[k] for k in ("tokens_per_s_median", "ratio_to_adamw_median",
                                             "optimizer_seconds_per_round_median",
                                             "ratio_to_adamw_pooled")}, indent=2))
    save(result, args.out)


if __name__ == "__main__":
    main()
