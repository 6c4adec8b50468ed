"""The run's knobs: one table for the flags, ``--config run.toml`` and the run's meta.

The coordinator resolves each knob (a flag beats the file, the file beats the default),
records them in its run header and publishes the ones ranks need in the run's ``meta``
hash, where every rank reads them (``from_meta``): a knob is set in one place for the
whole run. ``flodl-bus up`` takes the same flags and hands them to the coordinator.

Imports nothing of ours above ``partition``: the coordinator, the worker and the
launcher all read this table.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl_bus.partition import SHUFFLE_BASE_SEED

OUTERS: tuple[str, ...] = ("none", "nesterov", "slow-momentum")
GUARDS: tuple[str, ...] = ("trend", "msf", "none")


class SettingsError(ValueError):
    """A knob's value or the config file is wrong; the message names the fix."""


#: the largest count a knob takes: counts of batches, ranks and epochs stay far below it,
#: and every one fits the wire's 64-bit integers with room for arithmetic on it
MAX_COUNT = 1_000_000_000
#: seeds are added to an epoch's pass number and must stay an unsigned 64-bit value
MAX_SEED = 2**63 - 1


def _int(lo: int, hi: int = MAX_COUNT) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise SettingsError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise SettingsError(f"must be >= {lo} and <= {hi}, got {v}")
        return v

    return parse


def _float(lo: float, hi: float = math.inf, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise SettingsError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            bound = f"> {lo}" if lo_open else f">= {lo}"
            raise SettingsError(f"must be {bound}{'' if hi == math.inf else f' and <= {hi}'}")
        return v

    return parse


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise SettingsError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"expected true or false, got {text!r}")


def _max_failure(text: str) -> str:
    """``N`` dead ranks, or ``P%`` of the world."""
    t = text.strip()
    if t.endswith("%"):
        _float(0.0, 100.0, lo_open=True)(t[:-1])
    else:
        _int(0)(t)
    return t


def _speeds(text: str) -> tuple[float, ...]:
    """One relative speed per rank, ``1,2.5,1`` (a TOML array reads the same)."""
    parts = [t.strip() for t in text.strip().strip("[]()").split(",") if t.strip()]
    if not parts:
        raise SettingsError("expected one speed per rank, e.g. 1,2.5")
    return tuple(_float(0.0, lo_open=True)(t) for t in parts)


def _epochs(text: str) -> tuple[int, ...]:
    """Epochs, ``1,3`` (a TOML array or one number reads the same), each at least 1:
    a checkpoint at an epoch is taken as the run enters it, and nothing is trained
    before epoch 0."""
    parts = [t.strip() for t in text.strip().strip("[]()").split(",") if t.strip()]
    if not parts:
        raise SettingsError("expected one or more epochs, e.g. 2 or 2,5")
    return tuple(sorted({_int(1)(t) for t in parts}))


@dataclass(frozen=True, slots=True)
class Knob:
    key: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    #: published in the run's meta for the ranks (else the coordinator's alone)
    ranks: bool = False
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


KNOBS: tuple[Knob, ...] = (
    Knob("seed", _int(0, MAX_SEED), SHUFFLE_BASE_SEED, "shuffle seed of every epoch's order", True),
    Knob("epoch_splits", _int(1), 1, "cut each pass over the data into N epochs", True),
    Knob(
        "lr_scale_ratio",
        _float(0.0),
        1.0,
        "ranks scale the job's LR by 1 + (world_size - 1) * RATIO (1.0: flodl's linear "
        "scaling; 0: the job's schedule as given)",
        True,
    ),
    Knob(
        "max_failure",
        _max_failure,
        None,
        "stop (with a save) once more than N ranks, or P%% of the world, died",
        metavar="N|P%",
    ),
    Knob(
        "checkpoint_at_epoch",
        _epochs,
        None,
        "checkpoint as the run enters each of these epochs (E: after epochs 0..E-1 are "
        "trained), beside any --checkpoint-every; needs --save-path or a job "
        "checkpoint_fn",
        metavar="E[,E...]",
    ),
    Knob("anchor", _int(1), None, "initial batches per window of the slowest rank"),
    Knob(
        "min_anchor",
        _int(1),
        None,
        "floor of the anchor's overhead-driven growth (default: the initial anchor); a "
        "divergence nudge may still go below it",
    ),
    Knob("max_anchor", _int(1), 1000, "ceiling of the anchor (batches of the slowest rank)"),
    Knob(
        "overhead_target",
        _float(0.01, 0.5),
        0.05,
        "averaging overhead ElChe grows the anchor to stay under (0.01-0.5)",
    ),
    Knob("max_batch_diff", _int(0), None, "most batches a rank may run ahead (cpu throttle)"),
    Knob("max_overshoot", _int(0), None, "cpu-async: steps past its window a rank may run"),
    Knob(
        "relax_up",
        _bool,
        False,
        "cpu-async: each reduce the guard calls stable grows the anchor by one, within "
        "--max-batch-diff (true|false)",
        metavar="BOOL",
    ),
    Knob(
        "callback_rank",
        _int(0),
        None,
        "the rank that runs epoch callbacks, evals and checkpoints (default: the fastest)",
    ),
    Knob(
        "callback_slack",
        _bool,
        True,
        "give the callback rank less work in an epoch's last window (true|false)",
        metavar="BOOL",
    ),
    Knob(
        "speed_hints",
        _speeds,
        None,
        "relative rank speeds for the first counts and partitions, one per rank "
        "(needs a fixed --world-size)",
        metavar="S0,S1,...",
    ),
    Knob(
        "stage_advisories",
        _bool,
        False,
        "send StageAdvisory (each rank's span and next span) after every reduce; off "
        "by default: it costs a reduce O(world^2) (BENCHMARKS)",
        metavar="BOOL",
    ),
    Knob(
        "lockstep",
        _bool,
        False,
        "deterministic schedule (sync modes): every rank gets one batch per window and "
        "the next only after that window's average, so two runs, or a run and its "
        "resume, train bit for bit alike; slower (a round trip per step); the ranks "
        "then keep their thread share instead of sizing it to the work",
        True,
        metavar="BOOL",
    ),
    Knob(
        "guard",
        _choice(GUARDS),
        "trend",
        "divergence guard: trend vetoes growth, msf may also shrink the anchor, none",
    ),
    Knob(
        "meta_controller",
        _bool,
        True,
        "LR-aware meta-controller: shrink the anchor after an LR drop (true|false)",
        metavar="BOOL",
    ),
    Knob(
        "outer",
        _choice(OUTERS),
        "none",
        "outer optimizer on the consensus: none, nesterov (DiLoCo: each round also "
        "resets the ranks' inner optimizer), slow-momentum (SlowMo: keeps it)",
        True,
    ),
    Knob("outer_lr", _float(0.0, lo_open=True), None, "outer optimizer LR", True),
    Knob("outer_momentum", _float(0.0, 1.0), None, "outer optimizer momentum", True),
    Knob(
        "bf16_wire",
        _bool,
        False,
        "cpu modes: ship each rank's params change in bf16 (half the bytes of the "
        "averaging round; the params stay f32) (true|false)",
        True,
        metavar="BOOL",
    ),
    Knob(
        "overlap_rounds",
        _bool,
        True,
        "cpu-cadence: a rank trains through an averaging round and keeps the steps it "
        "took meanwhile on top of the consensus; false: it waits for the round (flodl) "
        "(true|false)",
        True,
        metavar="BOOL",
    ),
    Knob(
        "bridges",
        _bool,
        True,
        "cpu-cadence: a rank whose window is full trains on (a bridge chunk of its data) "
        "while a slower rank finishes its window, instead of waiting for the round; needs "
        "--overlap-rounds (nccl-cadence always bridges) (true|false)",
        metavar="BOOL",
    ),
    Knob(
        "user_group",
        _bool,
        True,
        "ranks set up torch.distributed's default group (gloo on CPU, NCCL on GPU) for the "
        "job's own collectives before its code runs, and re-form it after a death; false: "
        "the job's code makes its own (true|false)",
        True,
        metavar="BOOL",
    ),
    Knob(
        "easgd_alpha",
        _float(0.0, 1.0, lo_open=True),
        None,
        "EASGD blend weight of the consensus (cpu-async default 0.5)",
        True,
    ),
)
BY_KEY: dict[str, Knob] = {k.key: k for k in KNOBS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The knob flags and ``--config``; unset flags stay None so the file can fill them."""
    group = parser.add_argument_group("run settings (also keys of --config run.toml)")
    group.add_argument(
        "--config", metavar="TOML", help="read these settings from a TOML file (flags win)"
    )
    for k in KNOBS:
        default = "" if k.default is None else f" (default {k.default})"
        group.add_argument(
            k.flag,
            dest=f"knob_{k.key}",
            metavar=k.metavar or k.key.upper(),
            help=k.help + default,
        )


#: keys of a run file that are ``up``'s own (what it launches), not the run's knobs:
#: the coordinator and the ranks skip them, ``up`` reads them with ``read_launch``
LAUNCH_KEYS: dict[str, type] = {
    "job": str,
    "script": str,
    #: the script's own arguments, a list of strings (a command line's words after it)
    "script_args": list,
    "mode": str,
    "workers": int,
    "epochs": int,
    "eval_every": int,
    "device": str,
}


def _load(path: str | Path) -> tuple[Path, dict[str, Any]]:
    p = Path(path)
    try:
        return p, tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise SettingsError(f"--config: no file at {p}") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"--config {p}: {exc}") from None


def read_launch(path: str | Path) -> dict[str, Any]:
    """The launch keys of a run file (``up``'s: job or script and its script_args, mode,
    workers, epochs, eval_every, device), each checked for its type; a wrong one names
    itself. A relative script is the file's neighbour."""
    p, raw = _load(path)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        kind = LAUNCH_KEYS.get(name)
        if kind is None:
            continue
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SettingsError(f"--config {p}: {key}: use a whole number of 1 or more")
        if kind is str and not isinstance(value, str):
            raise SettingsError(f"--config {p}: {key}: use a string")
        if kind is list and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise SettingsError(f'--config {p}: {key}: use a list of strings, ["--lr", "0.1"]')
        if name == "script":
            # Beside the file, as a path in it reads: the run starts from any directory.
            value = str((p.parent / value).resolve())
        out[name] = value
    if "job" in out and "script" in out:
        raise SettingsError(f"--config {p}: job and script exclude each other: keep one")
    if "script_args" in out and "script" not in out:
        raise SettingsError(f"--config {p}: script_args without a script")
    return out


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML file of knob keys (and ``up``'s launch keys, skipped here); an unknown key
    or a bad value names itself."""
    p, raw = _load(path)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key.replace("-", "_") in LAUNCH_KEYS:
            continue
        knob = BY_KEY.get(key.replace("-", "_"))
        if knob is None:
            known = ", ".join([*BY_KEY, *LAUNCH_KEYS])
            raise SettingsError(f"--config {p}: unknown key {key!r}; known keys: {known}")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        try:
            out[knob.key] = knob.parse(text)
        except SettingsError as exc:
            raise SettingsError(f"--config {p}: {key}: {exc}") from None
    return out


def resolve(
    args: argparse.Namespace, job_defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Every knob's value: the flag, else ``--config``'s, else what the job asks for
    (``Job.knob_defaults``: the coordinator, which loads the job), else the default."""
    from_file = read_file(args.config) if getattr(args, "config", None) else {}
    job_defaults = job_defaults or {}
    values: dict[str, Any] = {}
    for k in KNOBS:
        flag = getattr(args, f"knob_{k.key}", None)
        if flag is not None:
            try:
                values[k.key] = k.parse(str(flag))
            except SettingsError as exc:
                raise SettingsError(f"{k.flag}: {exc}") from None
        elif k.key in from_file:
            values[k.key] = from_file[k.key]
        elif k.key in job_defaults:
            values[k.key] = job_defaults[k.key]
        else:
            values[k.key] = k.default
    return values


def lr_scale(ratio: float, world_size: int) -> float:
    """flodl's LR scaling (reference §3.13): the factor every rank of ``world_size``
    applies to the job's LR at ``lr_scale_ratio`` ``ratio``."""
    return 1.0 + (world_size - 1) * ratio


def world_mismatch(values: Mapping[str, Any], world_size: int) -> str | None:
    """What in the resolved knobs cannot fit a world of ``world_size`` (one line), or
    None: checked by a launcher that knows the world before anything starts."""
    rank = values.get("callback_rank")
    if rank is not None and not 0 <= rank < world_size:
        return (
            f"--callback-rank {rank} is not a rank of {world_size} worker(s): use "
            f"0..{world_size - 1}, or leave it unset"
        )
    hints = values.get("speed_hints")
    if hints is not None and len(hints) != world_size:
        return (
            f"--speed-hints gives {len(hints)} speed(s) for {world_size} worker(s): give one each"
        )
    return None


def argv(args: argparse.Namespace) -> list[str]:
    """The flags given on this command line, to hand on to another (``up``)."""
    out: list[str] = []
    if getattr(args, "config", None):
        out += ["--config", str(args.config)]
    for k in KNOBS:
        v = getattr(args, f"knob_{k.key}", None)
        if v is not None:
            out += [k.flag, str(v)]
    return out


def to_meta(values: Mapping[str, Any]) -> dict[str, str]:
    """The ranks' knobs as meta hash fields ("" = unset)."""
    return {
        k.key: "" if values.get(k.key) is None else _text(values[k.key]) for k in KNOBS if k.ranks
    }


def from_meta(meta: Mapping[str, str]) -> dict[str, Any]:
    """The ranks' knobs read back from meta; absent or empty fields take the default,
    except ``lr_scale_ratio``: a run published before it existed scaled nothing."""
    out: dict[str, Any] = {}
    for k in KNOBS:
        if not k.ranks:
            continue
        text = meta.get(k.key)
        if text:
            out[k.key] = k.parse(text)
        else:
            out[k.key] = 0.0 if k.key == "lr_scale_ratio" else k.default
    return out


def _text(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)
