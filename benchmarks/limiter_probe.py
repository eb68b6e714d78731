"""How often Fira's norm-growth limiter binds on a recipe, step by step.

    python benchmarks/limiter_probe.py --recipe tiny --rank 16 --steps 70 --out /tmp/limiter_probe.json

Trains Fira as ``fira-train pretrain`` does (:func:`fira_train.run.train.train_step`, one CPU thread)
and records at every step the limiter factor f = gamma / max(||S_t|| / ||S_{t-1}||, gamma) of
each projected matrix: the fraction of matrices with f < 1 (limited), the mean and the minimum
f. Prints every 10 steps and writes all steps as JSON. Used in docs/results/tiny/README.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import get_recipe
from fira_train.data.build import build_corpus
from fira_train.run.train import train_step
from fira_train.run.training import autocast_for, build_training, resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="/tmp/limiter_probe.json")
    args = parser.parse_args()

    factors: list[torch.Tensor] = []  # this step's limiter factors, one per projected matrix

    def recording(_optimizer, stats):
        factors.extend(s.limiter_factor.detach().reshape(1) for s in stats if s.limiter_factor is not None)

    config = apply_overrides(get_recipe(args.recipe), ["optim.method=fira", f"optim.rank={args.rank}"])
    torch.set_num_threads(1)
    corpus = build_corpus(config.data)
    device = resolve_device(config)
    training = build_training(config, corpus.vocab_size, device)
    training.optimizer.register_step_stats_hook(recording)
    stream = corpus.train_batches(config.train.micro_batch, config.train.seed)
    autocast = autocast_for(config, device)
    out = []
    for step in range(1, args.steps + 1):
        factors.clear()
        loss, _ = train_step(training, config, stream, autocast, step)
        f = torch.cat(factors)
        out.append({"step": step, "loss": loss, "limited_fraction": float((f < 1).float().mean()),
                    "mean_factor": float(f.mean()), "min_factor": float(f.min())})
        if step % 10 == 0:
            print(out[-1], flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
