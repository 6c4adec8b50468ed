"""The narrow ports ``WorkerControl`` reaches the model through (besides ``ParamPort``).

The core never imports torch: checkpoint, eval and save go through ``ModelPort``; prefetch
hints through ``Stager``. The runtime supplies torch-backed implementations
(``worker.model_port``); replay supplies ones that answer from the record.
"""

from __future__ import annotations

from typing import Protocol

from flodl_bus.protocol.messages import SaveReason, StageAdvisory


class ModelPort(Protocol):
    """What the control core may ask of the model. Every method may raise; the core
    turns an exception into the ``error`` text of the result it reports."""

    @property
    def has_checkpoint_fn(self) -> bool: ...

    @property
    def has_eval_fn(self) -> bool: ...

    @property
    def has_eval_dataset(self) -> bool: ...

    @property
    def has_save_path(self) -> bool: ...

    def checkpoint(self, version: int) -> None:
        """Run the user's checkpoint callback for ``version``."""
        ...

    def eval_mode(self) -> None: ...

    def train_mode(self) -> None: ...

    def evaluate(self) -> float:
        """The user's eval callback on the held-out dataset, scoring the live model
        (already in eval mode)."""
        ...

    def evaluate_consensus(self) -> float:
        """The same callback scoring the last realized consensus in place of the live
        model, which is restored exactly afterwards (``adopt_consensus``)."""
        ...

    def save_bundle(self, reason: SaveReason) -> None:
        """Write the checkpoint bundle (model + optimizer) under the save path."""
        ...

    def save_consensus(self) -> None:
        """Write the current (post-collective consensus) model under the save path."""
        ...

    def save_rank_state(self) -> None:
        """Write this rank's optimizer, outer optimizer and random state under the save
        path (``<stem>.rank<r>.state.pt``), beside a consensus save."""
        ...


class Stager(Protocol):
    """A background data stager (prefetch); advisories are hints, latest wins."""

    def advise(self, advisory: StageAdvisory) -> None: ...
