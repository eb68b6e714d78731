r"""``fira-train finetune``: fine-tune a pretrained causal LM on the commonsense tasks and evaluate it.

The paper's fine-tuning experiment (Section 5.3, Appendix B.2) at a size a laptop runs: train on
the union of the tasks' training sets in the LLM-Adapters format (of the commonsense data, ARC-Easy,
ARC-Challenge, BoolQ and OpenBookQA have one), then evaluate 500 seeded examples of every task's
test set (``--max-eval``). ``--scoring loglik`` (default) picks the option of largest
log-likelihood, scored by lm-eval (:mod:`.choices` poses the question, :mod:`.loglik` scores it);
``--scoring generate`` is the paper's protocol, generating and extracting the answer, but
greedy where the released script decodes with 4 beams (:mod:`.commonsense`, :mod:`.evaluate`). Methods, compared at equal steps, batch and
learning-rate schedule (linear, warm-up):

============  ==========================================================================
``none``      zero-shot: no training (also ``--steps 0``)
``adamw``     full fine-tuning, ``torch.optim.AdamW``
``lora``      LoRA adapters (``r=32``, ``lora_alpha=64``, dropout 0.05 on q,k,v,up,down), AdamW
``galore``    full fine-tuning, GaLore (``fira_optim`` with the residual dropped) on the
              ``--target-modules`` weights (default all linear layers), AdamW elsewhere
``fira``      full fine-tuning, Fira on the same weights
``fira-lora`` the LoRA adapters above, Fira (rank 16) on lora_A / lora_B; ``--recipe released``
              fixes the released script's setting (this, at lr 1e-4)
============  ==========================================================================

Outputs in ``--out``: ``results.json`` (config, per-task accuracy, average, memory, time, loss),
``report.md`` (accuracies with 95% Wilson intervals, :mod:`.stats`) and
``predictions/<task>.jsonl`` (per example: its index in the test file and whether it was right,
which pairs two runs for McNemar's test, :mod:`.paired`); the results of an earlier run there
are only replaced with ``--overwrite``. Every task needs a non-empty test set (an empty one has no accuracy
to average).

The command line is :mod:`.cli` (also ``python -m fira_train.finetune``), its options
:mod:`.config`; :func:`fira_train.finetune.run.run_finetune` runs one configuration: records and
batches (:mod:`.data`), training (:mod:`.train`), evaluation (:mod:`.loglik` or :mod:`.evaluate`)
on the tasks of :mod:`.commonsense`, and the report (:mod:`.report`).
"""

