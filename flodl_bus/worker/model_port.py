"""The torch side of ``ModelPort``: checkpoint, eval and save on a live ``nn.Module``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from flodl_bus.job import ArrayDataset
from flodl_bus.protocol.messages import SaveReason

#: The rank that writes the model of a checkpoint bundle (every rank writes its optimizer,
#: since per-rank momentum differs).
PRIMARY_RANK = 0

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


class TorchModelPort:
    def __init__(
        self,
        *,
        rank: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        eval_fn: Callable[[nn.Module, ArrayDataset], float] | None = None,
        eval_data: ArrayDataset | None = None,
        checkpoint_fn: CheckpointFn | None = None,
        save_path: str | None = None,
    ) -> None:
        self.rank = rank
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
        self.checkpoint_fn(version, self.model)

    def eval_mode(self) -> None:
        self.model.eval()

    def train_mode(self) -> None:
        self.model.train()

    def evaluate(self) -> float:
        if self.eval_fn is None or self.eval_data is None:
            raise RuntimeError("no eval_fn or eval dataset")
        with torch.no_grad():
            return float(self.eval_fn(self.model, self.eval_data))

    def save_bundle(self, reason: SaveReason) -> None:
        stem = self._stem()
        stem.parent.mkdir(parents=True, exist_ok=True)
        if self.rank == PRIMARY_RANK:
            _atomic_save(self.model.state_dict(), stem.with_name(stem.name + ".model.pt"))
            meta = {"reason": reason.snake, "writer_rank": self.rank}
            # Not ``.meta.json``: that is the coordinator's checkpoint meta (coverage,
            # counters), written just before ShutdownWithSave; overwriting it here
            # would make the run impossible to resume.
            stem.with_name(stem.name + ".bundle.json").write_text(json.dumps(meta))
        if self.optimizer is not None:
            path = stem.with_name(f"{stem.name}.rank{self.rank}.optim.pt")
            _atomic_save(self.optimizer.state_dict(), path)

    def save_consensus(self) -> None:
        stem = self._stem()
        stem.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(self.model.state_dict(), stem.with_name(stem.name + ".model.pt"))

    def _stem(self) -> Path:
        if self.save_path is None:
            raise RuntimeError("no save path set")
        return Path(self.save_path)
