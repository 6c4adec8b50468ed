"""The torch side of ``ModelPort``: checkpoint, eval and save on a live ``nn.Module``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from flodl_bus.job import TrainData
from flodl_bus.protocol.messages import SaveReason
from flodl_bus.worker.resume import save_rank_state

#: The rank that writes the model of a checkpoint bundle before the coordinator named an
#: epoch-callback role (every rank writes its own state, ``worker.resume``).
PRIMARY_RANK = 0
#: the longest a consensus eval waits for its round's ack to leave (then it scores anyway)
ROUND_SETTLE_S = 5.0

CheckpointFn = Callable[[int, nn.Module], None]


def _atomic_save(obj: object, path: Path) -> None:
    # Write then rename, so a crash mid-write never leaves a truncated file that a
    # resume would trust.
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def checkpoint_to(stem: str) -> CheckpointFn:
    """A checkpoint callback writing ``<stem>.v<version>.pt`` (the model's state dict)."""

    def write(version: int, model: nn.Module) -> None:
        path = Path(f"{stem}.v{version}.pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(model.state_dict(), path)

    return write


@runtime_checkable
class ConsensusSource(Protocol):
    """A param plane that keeps the last realized consensus (``TorchParamPort``)."""

    def consensus(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None: ...


class TorchModelPort:
    def __init__(
        self,
        *,
        rank: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        eval_fn: Callable[[nn.Module, Any], float] | None = None,
        eval_data: TrainData | None = None,
        checkpoint_fn: CheckpointFn | None = None,
        save_path: str | None = None,
        consensus: ConsensusSource | None = None,
        params: object | None = None,
        writer_role: Callable[[], int | None] | None = None,
    ) -> None:
        self.rank = rank
        #: the rank's param plane, whose outer optimizer state a bundle saves
        self.params = params
        #: the rank that writes a bundle's model: the epoch-callback role as the core
        #: knows it (None: ``PRIMARY_RANK``)
        self.writer_role = writer_role
        #: where the consensus comes from (None: the live model is the consensus, as in
        #: a world of one)
        self.consensus = consensus
        self.model = model
        self.optimizer = optimizer
        self.eval_fn = eval_fn
        self.eval_data = eval_data
        self.checkpoint_fn = checkpoint_fn
        self.save_path = save_path

    @property
    def has_checkpoint_fn(self) -> bool:
        return self.checkpoint_fn is not None

    @property
    def has_eval_fn(self) -> bool:
        return self.eval_fn is not None

    @property
    def has_eval_dataset(self) -> bool:
        return self.eval_data is not None

    @property
    def has_save_path(self) -> bool:
        return self.save_path is not None

    def checkpoint(self, version: int) -> None:
        if self.checkpoint_fn is None:
            raise RuntimeError("no checkpoint_fn")
        # The checkpoint holds the consensus, not the live model that trained on after
        # it (swapped in for the call, then back).
        with torch.no_grad(), self._consensus_swapped_in():
            self.checkpoint_fn(version, self.model)

    def eval_mode(self) -> None:
        self.model.eval()

    def train_mode(self) -> None:
        self.model.train()

    def evaluate(self) -> float:
        """The live model's score."""
        if self.eval_fn is None or self.eval_data is None:
            raise RuntimeError("no eval_fn or eval dataset")
        with torch.no_grad():
            return float(self.eval_fn(self.model, self.eval_data))

    def evaluate_consensus(self) -> float:
        """The last realized consensus's score (flodl's ``adopt_consensus``): swapped
        into the model for the call, and the live values put back bit for bit (under
        cpu-async the live model is the EASGD blend, which is not the consensus)."""
        if self.eval_fn is None or self.eval_data is None:
            raise RuntimeError("no eval_fn or eval dataset")
        self._round_settled()
        with torch.no_grad(), self._consensus_swapped_in():
            return float(self.eval_fn(self.model, self.eval_data))

    def _round_settled(self) -> None:
        """Before a consensus eval, let the round that made the consensus send its ack.

        The eval runs as soon as the consensus is adopted, while the averaging thread
        still takes the divergence pass its ``SyncAck`` carries: the two shared the GIL,
        and the coordinator sends every rank its next plan only after every ack, so the
        whole world waited out this rank's eval at each epoch's end. The scored model is
        the same either way (the consensus, before any further step)."""
        cpu = getattr(self.params, "cpu", None)
        wait_idle = getattr(cpu, "wait_idle", None)
        if callable(wait_idle):
            wait_idle(ROUND_SETTLE_S)

    def save_bundle(self, reason: SaveReason) -> None:
        stem = self._stem()
        stem.parent.mkdir(parents=True, exist_ok=True)
        role = None if self.writer_role is None else self.writer_role()
        # flodl: the epoch-callback role rank writes the model (rank 0 before any role).
        if self.rank == (PRIMARY_RANK if role is None else role):
            _atomic_save(self.consensus_state_dict(), stem.with_name(stem.name + ".model.pt"))
            meta = {"reason": reason.snake, "writer_rank": self.rank}
            # Not ``.meta.json``: that is the coordinator's checkpoint meta (coverage,
            # counters), written just before ShutdownWithSave; overwriting it here
            # would make the run impossible to resume.
            stem.with_name(stem.name + ".bundle.json").write_text(json.dumps(meta))
        # Every rank: its optimizer, outer optimizer and random state differ.
        save_rank_state(stem, self.rank, self.optimizer, self.params)

    def save_consensus(self) -> None:
        stem = self._stem()
        stem.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(self.consensus_state_dict(), stem.with_name(stem.name + ".model.pt"))

    def save_rank_state(self) -> None:
        save_rank_state(self._stem(), self.rank, self.optimizer, self.params)

    def consensus_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the last realized consensus in place of the live
        parameters and averaged buffers (the live model before any round)."""
        state = self.model.state_dict()
        got = None if self.consensus is None else self.consensus.consensus()
        if got is None:
            return state
        for name, t in self._consensus_names(got):
            state[name] = t.detach().to("cpu", copy=True)
        return state

    def _consensus_names(
        self, got: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        params, buffers = got
        pairs = [(n, c) for (n, _), c in zip(self.model.named_parameters(), params)]
        # Only float buffers are averaged (counters stay local): match them by identity.
        named = {id(b): n for n, b in self.model.named_buffers()}
        live = [b for b in self.model.buffers() if b.dtype == torch.float32]
        pairs += [(named[id(b)], c) for b, c in zip(live, buffers) if id(b) in named]
        return pairs

    @contextmanager
    def _consensus_swapped_in(self) -> Iterator[None]:
        got = None if self.consensus is None else self.consensus.consensus()
        if got is None:
            yield
            return
        live = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        saved = []
        for name, c in self._consensus_names(got):
            t = live[name]
            saved.append((t, t.detach().clone()))
            t.data.copy_(c)
        try:
            yield
        finally:
            for t, old in saved:
                t.data.copy_(old)

    def _stem(self) -> Path:
        if self.save_path is None:
            raise RuntimeError("no save path set")
        return Path(self.save_path)
