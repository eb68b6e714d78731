"""The largest embedding entry after a few Fira steps, with fp32 and with int8 optimizer states.

    python benchmarks/int8_embedding_rows.py [--steps 10] [--out docs/benchmarks/int8_embedding_rows.json]

``micro``'s LLaMA (d_model 64) with a 96-token vocabulary, Fira at rank 8, T = 2, lr 0.01, each
step on four sequences counting upwards from random starts (a pattern it can learn), so most
vocabulary rows see gradients only now and then. With second moments coded as values in int8,
such a row's v rounded to 0 while its m did not, and m / (sqrt(v) + eps) threw the row; the
numbers quoted under "Memory" in docs/optimizer.md come from this script. One run measures fp32
states, int8 states as they are coded (second moments as their square roots) and int8 with the
former coding (second moments as values), side by side.
"""

from __future__ import annotations

import argparse

import torch

import fira_optim.precision
from record import machine, provenance, save

from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import micro
from fira_train.methods.model import build_model
from fira_train.methods.registry import build_method

VOCAB, SEQ = 96, 16


def largest_embedding_entry(state_dtype: str, steps: int) -> float:
    config = apply_overrides(micro(), ["optim.method=fira", "optim.rank=8", "optim.update_proj_gap=2",
                                       "model.hidden_size=64", f"optim.state_dtype={state_dtype}"])
    setup = build_method(build_model(config.model, VOCAB, SEQ, seed=0), config)
    for step in range(steps):
        start = torch.randint(0, VOCAB, (4, 1), generator=torch.Generator().manual_seed(step))
        batch = (start + torch.arange(SEQ)) % VOCAB
        setup.model(input_ids=batch, labels=batch).loss.backward()
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
    return setup.model.get_input_embeddings().weight.abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    largest = {"float32": largest_embedding_entry("float32", args.steps),
               "int8": largest_embedding_entry("int8", args.steps)}
    root = fira_optim.precision.ROOT
    fira_optim.precision.ROOT = frozenset()  # the former coding: every int8 moment stored as values
    try:
        largest["int8, second moments as values"] = largest_embedding_entry("int8", args.steps)
    finally:
        fira_optim.precision.ROOT = root
    for name, value in largest.items():
        print(f"{name}: largest embedding entry {value:.4g} after {args.steps} steps")
    save({**provenance(), "machine": machine(),
          "steps": args.steps, "largest_embedding_entry": largest}, args.out)


if __name__ == "__main__":
    main()
