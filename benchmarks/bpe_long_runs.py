"""Time of training the byte-level BPE on short documents plus one long run of letters without
whitespace, whole and cut into pieces of fira_train.data.tokenizer.LONGEST_WORD characters.

    python benchmarks/bpe_long_runs.py [--letters 100000] [--documents 300] [--vocab 2000]

The numbers quoted at ``LONGEST_WORD`` in src/fira_train/data/tokenizer.py come from this script.
"""

from __future__ import annotations

import argparse
import random
import time

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from fira_train.data.tokenizer import _cut_long_runs


def seconds_to_train(texts: list[str], vocab: int) -> float:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    started = time.perf_counter()
    backend.train_from_iterator(texts, trainer=trainer)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--letters", type=int, default=100_000)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "theory", "history", "science", "music"]
    texts = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(args.documents)]
    texts.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(args.letters)))
    whole = seconds_to_train(texts, args.vocab)
    cut = seconds_to_train([_cut_long_runs(t) for t in texts], args.vocab)
    print(f"{args.documents} documents + a run of {args.letters} letters, {args.vocab} entries: "
          f"whole {whole:.1f} s, cut {cut:.1f} s")


if __name__ == "__main__":
    main()
