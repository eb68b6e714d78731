"""How often Fira's norm-growth limiter binds on the `tiny` recipe at rank 16, step by step.

    python benchmarks/limiter_probe.py 60 /tmp/limiter_probe.json

Trains Fira (rank 16) on `tiny` exactly as the harness builds it (one thread) and records, at
every step, the limiter factor f = gamma / max(||S_t|| / ||S_{t-1}||, gamma) of each projected
matrix: the fraction of matrices with f < 1 (limited) and the mean and minimum f, printed every
10 steps and written as JSON at the end. Used in docs/results/tiny/README.md.
"""
import json, sys, torch
import fira_optim.update as update
from fira_train.data import build_corpus
from fira_train.overrides import apply_overrides
from fira_train.recipes import get_recipe
from fira_train.train import build_training, resolve_device

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
records = []
original = update.limiter_factor
def recording(kind, norm, prev_norm, **kw):
    f = original(kind, norm, prev_norm, **kw)
    records[-1].append(f.detach().flatten().clone())
    return f
update.limiter_factor = recording
config = apply_overrides(get_recipe("tiny"), ["optim.method=fira", "optim.rank=16"])
torch.set_num_threads(1)
corpus = build_corpus(config.data)
device = resolve_device(config)
training = build_training(config, corpus.vocab_size, device)
model, opt = training.setup.model, training.setup.optimizer
stream = corpus.train_batches(config.train.batch_size, config.train.seed)
out = []
for step in range(1, steps + 1):
    records.append([])
    ids = next(stream)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step(); training.scheduler.step(); opt.zero_grad(set_to_none=True)
    f = torch.cat(records[-1])
    out.append({"step": step, "loss": float(loss.detach()), "limited_fraction": float((f < 1).float().mean()),
                "mean_factor": float(f.mean()), "min_factor": float(f.min())})
    if step % 10 == 0:
        print(out[-1], flush=True)
json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/limiter_probe.json", "w"))
