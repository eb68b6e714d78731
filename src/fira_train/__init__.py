"""fira_train: the pre-training harness of fira-optim (data, models, training loop, reports).

Its subpackages are layers, each importing only the ones below it (``lint-imports`` checks this):

- :mod:`fira_train.cli`: the ``fira-train`` command line;
- :mod:`fira_train.cli_args`, :mod:`fira_train.user_errors`: what only the command line uses
  (``key=value`` overrides among the flags, one-line errors);
- :mod:`fira_train.analysis`, :mod:`fira_train.compare`, :mod:`fira_train.finetune`: the paper's
  analyses, the comparison of methods, fine-tuning;
- :mod:`fira_train.report`: reports built from finished run directories;
- :mod:`fira_train.run`: one training run (loop, checkpoints, parallelism, logs);
- :mod:`fira_train.config`: what a run is (config dataclasses, recipes, overrides);
- :mod:`fira_train.data`, :mod:`fira_train.memory`, :mod:`fira_train.methods`: corpora and
  tokenizers, memory estimates, the method registry and the models;
- :mod:`fira_train.files`, :mod:`fira_train.provenance`: file helpers (digests, fsync, the run's
  JSON files), and the code version a run records.

Submodules are imported on demand (``from fira_train.data.build import build_corpus``), so that
``import fira_train`` stays cheap and does not pull in transformers.
"""
