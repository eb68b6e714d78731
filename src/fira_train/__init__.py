"""fira_train: the pre-training harness of fira-optim (data, models, training loop, reports).

Submodules are imported on demand (``from fira_train.data import build_corpus``) so that
``import fira_train`` stays cheap and does not pull in transformers.
"""
