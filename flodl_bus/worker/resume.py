"""What a rank needs, beside the consensus model, for a resumed run to go on as if it
had never stopped: its optimizer's state (per-rank: Adam moments and momentum differ),
the param plane's outer optimizer state (Nesterov / slow momentum, DiLoCo) and its torch
random state (dropout, augmentation). Written as ``<stem>.rank<r>.state.pt``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog
import torch

_log = structlog.get_logger("flodl_bus.worker")

#: bumped when the file's layout changes; an older file is refused with the reason
STATE_SCHEMA = 1


def state_path(stem: str | Path, rank: int) -> Path:
    stem = Path(stem)
    return stem.with_name(f"{stem.name}.rank{rank}.state.pt")


def rank_state(optimizer: torch.optim.Optimizer | None, params: object) -> dict[str, Any]:
    outer_of = getattr(params, "outer_state_dict", None)
    return {
        "schema": STATE_SCHEMA,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "outer": outer_of() if callable(outer_of) else None,
        "rng": torch.get_rng_state(),
        # Only where CUDA is in use already: a CPU rank on a GPU host must not start it.
        "cuda_rng": (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            else None
        ),
    }


def save_rank_state(
    stem: str | Path, rank: int, optimizer: torch.optim.Optimizer | None, params: object
) -> Path:
    """Write this rank's state beside the consensus model (write then rename: a crash
    mid-write never leaves a torn file that a resume would trust)."""
    path = state_path(stem, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(rank_state(optimizer, params), tmp)
    os.replace(tmp, path)
    return path


def restore_model(stem: str | Path, model: torch.nn.Module) -> None:
    """Load the saved consensus into ``model``; a file that is missing or does not fit
    this job's model raises ``ValueError`` in one line naming the fix."""
    path = Path(f"{stem}.model.pt")
    fix = "resume with the job and --save-path stem that wrote it"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"no consensus model at {path}; {fix}") from None
    except Exception as exc:
        raise ValueError(f"{path} is not a readable model ({_first_line(exc)}); {fix}") from None
    try:
        model.load_state_dict(state)
    except Exception as exc:
        raise ValueError(
            f"{path} does not fit this job's model ({_first_line(exc)}); {fix}"
        ) from None


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    # torch's load_state_dict says which keys and shapes in lines after its first.
    return " ".join(lines[:3])[:300]


def restore_rank_state(
    stem: str | Path, rank: int, optimizer: torch.optim.Optimizer | None, params: object
) -> bool:
    """Load this rank's saved state into ``optimizer``, the param plane's outer optimizer
    and torch's random state. False when the save holds none for this rank (a mid-run
    checkpoint saves the consensus model only: the rank goes on with a fresh optimizer,
    as the log line says). A file that does not fit raises ``ValueError`` naming it."""
    path = state_path(stem, rank)
    if not path.exists():
        _log.warning(
            "resume_without_rank_state",
            rank=rank,
            path=str(path),
            detail="no optimizer/outer/random state saved for this rank; starting them fresh",
        )
        return False
    try:
        # The safe loader: a rank state is tensors, numbers and containers only, and a
        # planted file must not run code (a resume stem can come from the run's meta).
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{path} is not a readable rank state ({_first_line(exc)}); resume from a "
            "stem this project wrote, or delete the file to start the rank's state fresh"
        ) from None
    if not isinstance(state, dict) or state.get("schema") != STATE_SCHEMA:
        raise ValueError(f"{path} is not a rank state of schema {STATE_SCHEMA}; cannot resume")
    if optimizer is not None and state["optimizer"] is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise ValueError(
                f"{path}: the optimizer state does not fit this job's optimizer ({exc})"
            ) from None
    outer = state.get("outer")
    if outer is not None:
        load_outer = getattr(params, "load_outer_state_dict", None)
        if not callable(load_outer):
            raise ValueError(
                f"{path} holds an outer optimizer state but this run has none; resume "
                "with the same --outer setting"
            )
        try:
            load_outer(outer)
        except (ValueError, KeyError) as exc:
            raise ValueError(
                f"{path}: the outer optimizer state does not fit this run ({exc}); resume "
                "with the same --outer setting"
            ) from None
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return True
