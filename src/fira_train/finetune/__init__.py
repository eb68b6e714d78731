r"""``fira-train finetune``: fine-tune a pretrained causal LM on the commonsense tasks and evaluate it.

The paper's fine-tuning experiment (Section 5.3, Appendix B.2) at a size a laptop runs: train on
the union of the tasks' training sets in the LLM-Adapters format, then evaluate every task's test
set by generating and extracting the answer (:mod:`fira_train.finetune.commonsense`). Methods,
compared at equal steps, batch and learning-rate schedule (linear, warm-up):

============  ==========================================================================
``none``      zero-shot: no training (also ``--steps 0``)
``adamw``     full fine-tuning, ``torch.optim.AdamW``
``lora``      LoRA adapters (``r=32``, ``lora_alpha=64``, dropout 0.05 on q,k,v,up,down), AdamW
``galore``    full fine-tuning, GaLore (``fira_optim`` with the residual dropped) on the
              ``--target-modules`` weights (default all linear layers), AdamW elsewhere
``fira``      full fine-tuning, Fira on the same weights
``fira-lora`` the released recipe: the LoRA adapters above, Fira (rank 16) on lora_A / lora_B
============  ==========================================================================

Outputs in ``--out``: ``results.json`` (config, per-task accuracy, average, memory, time, loss),
``report.md`` and ``predictions/<task>.jsonl``; the results of an earlier run there are only
replaced with ``--overwrite``. Every task needs a non-empty test set (an empty one has no accuracy
to average).

The command line is :mod:`.cli` (also ``python -m fira_train.finetune``), its options
:mod:`.config`; :func:`fira_train.finetune.run.run_finetune` runs one configuration: records and
batches (:mod:`.data`), training (:mod:`.train`), evaluation (:mod:`.evaluate`) on the tasks of
:mod:`.commonsense`, and the report (:mod:`.report`).
"""

