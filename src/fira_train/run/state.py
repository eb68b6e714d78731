"""What a one-process checkpoint holds: everything a run needs to continue exactly.

A checkpoint payload (:func:`capture_state`) has the model, optimizer and scheduler state
dicts, the data stream position (``BatchStream.state_dict()``), the Python, NumPy, torch and
CUDA generator states, the step, the run's running totals (tokens, training time), the loss
scale of ``train.precision=fp16`` and the state of the run's callbacks
(:class:`~fira_train.run.callbacks.TrainCallback`: an analysis's noise generator or running
moments). It holds tensors and plain Python values only, so ``torch.load(weights_only=True)``
reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fira_train.data.corpus import data_change
from fira_train.run.callbacks import TrainCallback, callback_states, load_callback_states
from fira_train.run.checkpoint import CheckpointError
from fira_train.run.rng import rng_state, set_rng_state
from fira_train.run.training import Training

log = logging.getLogger(__name__)


def capture_state(step: int, training: Training, stream: Any, progress: dict[str, float],
                  callbacks: Sequence[TrainCallback] = ()) -> dict[str, Any]:
    """The checkpoint payload: tensors and plain Python values only (``weights_only`` loads it)."""
    return {
        "step": step,
        "model": training.model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "data": stream.state_dict(),
        "rng": rng_state(),
        "progress": dict(progress),
        "callbacks": callback_states(callbacks),
        "loss_scale": training.loss_scale_state(),  # train.precision=fp16; else None
        **corpus_record(stream),
    }


#: What a checkpoint records of the data its stream reads (see ``BatchStream``).
DATA_RECORD = ("corpus", "token_digest")


def corpus_record(stream: Any) -> dict[str, str]:
    """``{"corpus": fingerprint, "token_digest": digest}`` of the data ``stream`` reads, for a checkpoint
    (what it does not know is left out: :func:`check_corpus` then has less to compare)."""
    return {key: getattr(stream, key) for key in DATA_RECORD if getattr(stream, key, None)}


def check_corpus(saved: Mapping[str, Any], stream: Any, source: str) -> None:
    """ValueError if a checkpoint (``saved``: its payload, or the part of it that
    :func:`corpus_record` wrote) was trained on other data than ``stream`` reads, as
    :func:`fira_train.data.corpus.data_change` decides; nothing where either side does not know (a
    checkpoint written before corpora were fingerprinted)."""
    record = {key: saved.get(key) for key in DATA_RECORD}
    current = corpus_record(stream)
    if current and not any(record.values()):
        log.warning("the checkpoint records no fingerprint of its data (written before they were recorded): "
                    "whether data.source=%r still gives the data it was trained on is not checked", source)
    change = data_change(record, current)
    if change:
        raise ValueError(f"the checkpoint was trained on other data than data.source={source!r} gives now "
                         f"({change}); resume with the data it was trained on, or start the run again "
                         "(--overwrite)")


def restore_state(state: dict[str, Any], training: Training, stream: Any, source: str,
                  callbacks: Sequence[TrainCallback] = ()) -> tuple[int, dict[str, float]]:
    """Load a checkpoint payload into freshly built objects and ``callbacks`` (``source``:
    ``data.source``, for an error); returns (step, progress)."""
    missing = {"step", "model", "optimizer", "scheduler", "data", "rng", "progress"} - set(state)
    if missing:
        raise CheckpointError(f"checkpoint lacks {sorted(missing)}")
    check_corpus(state, stream, source)
    load_callback_states(callbacks, state.get("callbacks"))  # first: a refused one changes nothing else
    training.model.load_state_dict(state["model"])
    training.optimizer.load_state_dict(state["optimizer"])
    training.scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    training.load_loss_scale_state(state.get("loss_scale"))
    set_rng_state(state["rng"])
    return int(state["step"]), dict(state["progress"])
