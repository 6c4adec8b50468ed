"""A training job as one object: what a rank trains and how it is judged.

Users hand ``flodl-bus`` a ``MODULE:NAME`` pointing at a ``Job`` (or a zero-argument
callable returning one). Everything is built lazily inside each rank process so a job
object is cheap to import in the coordinator, which only needs the sizes.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import torch
from torch import nn
from torch.utils.data import IterableDataset

from flodl_bus.protocol.messages import EpochMetrics, IntentKind


@dataclass(frozen=True)
class ArrayDataset:
    """Features and labels as two tensors; a batch is a gather by pick index."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"dataset has {len(self.x)} inputs but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, picks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # A pick beyond the dataset wraps (augmentation passes reuse samples).
        idx = torch.as_tensor(picks, dtype=torch.long) % len(self.x)
        return self.x[idx], self.y[idx]

    def signature(self) -> str:
        """A short content hash so the coordinator can refuse a mismatched worker."""
        h = hashlib.sha256()
        h.update(str((tuple(self.x.shape), tuple(self.y.shape))).encode())
        h.update(self.x.contiguous().numpy().tobytes())
        h.update(self.y.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


class MapDataset(Protocol):
    """A map-style dataset with a length (``torch.utils.data.Dataset`` as users write it)."""

    def __getitem__(self, index: int) -> Any: ...

    def __len__(self) -> int: ...


#: What ``Job.train_data`` may return: the in-memory ``ArrayDataset`` (a batch is one
#: gather), or any map-style ``torch.utils.data.Dataset`` with a length (loaded by a
#: ``DataLoader``'s workers). Either way a rank trains the samples its picks name.
TrainData: TypeAlias = ArrayDataset | MapDataset


def check_train_data(data: object) -> TrainData:
    """``data`` if a rank can train from it; else a ``JobError`` naming the fix."""
    if isinstance(data, ArrayDataset):
        return data
    if isinstance(data, IterableDataset):
        raise JobError(
            "train_data returned an IterableDataset; return a map-style Dataset "
            "(__getitem__ and __len__) or an ArrayDataset: ranks train picked samples"
        )
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise JobError(
            f"train_data returned a {type(data).__name__}; return an ArrayDataset or a "
            "map-style torch.utils.data.Dataset with __getitem__ and __len__"
        )
    if len(data) < 1:  # type: ignore[arg-type]
        raise JobError("train_data returned an empty dataset")
    return data  # type: ignore[return-value]


def as_arrays(data: TrainData, where: str) -> ArrayDataset:
    """``data`` as an ``ArrayDataset``, for the parts that need one (``where`` says which)."""
    if not isinstance(data, ArrayDataset):
        raise JobError(f"{where} needs train_data to return an ArrayDataset")
    return data


def dataset_signature(data: TrainData) -> str:
    """What the coordinator compares to refuse a worker with other data: a content hash
    of an ``ArrayDataset``; the type and length of any other Dataset (its samples are
    not read for this)."""
    if isinstance(data, ArrayDataset):
        return data.signature()
    kind = f"{type(data).__module__}.{type(data).__qualname__}:{len(data)}"
    return hashlib.sha256(kind.encode()).hexdigest()[:16]


def model_signature(build: Callable[[], nn.Module]) -> str | None:
    """What the coordinator compares to refuse a worker that builds another model: a hash
    of the parameters' and buffers' names, shapes and dtypes, in order. The model is
    built on the meta device (no memory, no initialisation) with the random state put
    back, so telling it costs neither the job's RNG stream nor its time; a build that
    cannot run there (it loads weights, or places tensors itself) has no signature
    (None), and is not compared."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
        if not isinstance(model, nn.Module):
            return None
        parts = [
            f"{name}:{tuple(t.shape)}:{t.dtype}"
            for name, t in (*model.named_parameters(), *model.named_buffers())
        ]
    except Exception:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def accuracy(model: nn.Module, data: TrainData, chunk: int = 1024) -> float:
    """Top-1 accuracy, evaluated on the model's own device in chunks: an
    ``ArrayDataset`` sliced, any other map-style dataset of ``(x, y)`` samples loaded by
    a ``DataLoader`` (no workers, in order)."""
    device = next(model.parameters()).device
    correct = 0
    with torch.no_grad():
        for x, y in _eval_batches(data, chunk):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            correct += int((model(x).argmax(dim=1) == y).sum().item())
    return correct / max(len(data), 1)


def _eval_batches(data: TrainData, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(data, ArrayDataset):
        for start in range(0, len(data), chunk):
            yield data.x[start : start + chunk], data.y[start : start + chunk]
        return
    from torch.utils.data import DataLoader

    yield from DataLoader(data, batch_size=chunk, shuffle=False)  # type: ignore[arg-type]


def constant_lr(lr: float) -> Callable[[int], float]:
    return lambda _step: lr


#: What a rank does with a batch whose loss is NaN or infinite.
NonFinitePolicy = Literal["stop", "skip"]
NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = ("stop", "skip")


class JobError(Exception):
    """The job's own code failed: one of its callbacks raised, or its loss was not finite.

    ``str(exc)`` is the one line a person reads (``loss_fn raised ValueError: bad``); the
    original exception is ``__cause__`` (its traceback goes to the rank's log).
    """

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def describe_error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_T = TypeVar("_T")


def call_job(where: str, fn: Callable[..., _T], *args: object) -> _T:
    """Call the job's ``where`` callback; whatever it raises becomes a ``JobError`` that
    names the callback, so the console says which part of the job failed."""
    try:
        return fn(*args)
    except Exception as exc:
        raise JobError(f"{where} raised {describe_error(exc)}") from exc


@dataclass(frozen=True)
class Job:
    """What a run trains. Every builder is called inside the rank process."""

    name: str
    build_model: Callable[[], nn.Module]
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    #: an ``ArrayDataset`` or any map-style ``torch.utils.data.Dataset`` (``TrainData``)
    train_data: Callable[[], TrainData]
    #: held-out data for ``eval_fn``: an ``ArrayDataset`` or any map-style dataset
    eval_data: Callable[[], TrainData] | None = None
    #: loss of one batch; backward/step are done by the runtime
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor] = (
        classification_loss
    )
    #: model, held-out data -> metric (higher is better)
    eval_fn: Callable[[nn.Module, Any], float] | None = accuracy
    batch_size: int = 32
    num_epochs: int = 10
    #: learning rate as a pure function of the global step (every rank builds the same);
    #: None: the optimizer's own (each param group's LR as ``build_optimizer`` set it)
    lr_at: Callable[[int], float] | None = None
    #: learning rate as a pure function of (global step, the run's planned global steps);
    #: when set it replaces ``lr_at``, so a decaying schedule stretches with ``--epochs``
    #: instead of ending early (a longer run) or never decaying (a shorter one)
    lr_schedule: Callable[[int, int], float] | None = None
    max_grad_norm: float | None = None
    #: a finished run is "good" when the final eval reaches this
    target_metric: float | None = None
    #: called at every epoch change on the one rank the coordinator names for it
    #: (``SetEpochCallbackRole``), with the epoch about to start and the live model
    epoch_fn: Callable[[int, nn.Module], None] | None = None
    #: called with each epoch's ``EpochMetrics`` (the coordinator's aggregate of every
    #: rank's metrics, as ``EpochAggregated`` brings it), on the epoch-callback role rank;
    #: what it raises is logged and training goes on (flodl's ``metrics_fn``)
    metrics_fn: Callable[[EpochMetrics], None] | None = None
    #: called with ``(epoch, metric)`` of every successful eval the coordinator
    #: broadcasts (``EvalBroadcast``, the final eval included), on the epoch-callback
    #: role rank; what it raises is logged and training goes on
    eval_result_fn: Callable[[int, float], None] | None = None
    #: writes a checkpoint, ``(version, model)``, on the checkpoint role rank at every
    #: ``--checkpoint-every`` epoch boundary and after ``request_checkpoint()``; what it
    #: raises is reported and the coordinator fails over to another rank. None: the
    #: model's state dict to ``<save-path>.v<version>.pt`` when ``--save-path`` is given
    checkpoint_fn: Callable[[int, nn.Module], None] | None = None
    seed: int = 0
    #: a batch whose loss is NaN or infinite: ``"stop"`` the run (the rank reports a job
    #: failure, the coordinator ends the run with ``ShutdownWithSave(JOB_FAILED)``; no
    #: optimizer step is taken with it), or ``"skip"`` the batch (no optimizer step; its
    #: samples count as seen; the rank's metrics carry the count as ``nonfinite_skipped``)
    on_nonfinite_loss: NonFinitePolicy = "stop"
    #: how the ranks scale this job's LR with the world (``1 + (world_size - 1) *
    #: RATIO``) when the run does not say (``--lr-scale-ratio``, a ``--config`` file):
    #: None takes flodl's linear scaling (1.0), right for SGD, whose step grows with the
    #: batch; an adaptive optimizer's (Adam's) step does not, and 0 keeps its LR as given
    lr_scale_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.on_nonfinite_loss not in NONFINITE_POLICIES:
            raise ValueError(
                f"Job.on_nonfinite_loss must be one of {NONFINITE_POLICIES}, "
                f"got {self.on_nonfinite_loss!r}"
            )
        ratio = self.lr_scale_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio >= 0.0):
            raise ValueError(f"Job.lr_scale_ratio must be a number of 0 or more, got {ratio!r}")

    def knob_defaults(self) -> dict[str, Any]:
        """The run settings this job asks for where the run gives none
        (``settings.resolve``)."""
        return {} if self.lr_scale_ratio is None else {"lr_scale_ratio": self.lr_scale_ratio}

    def planned_steps(self, epochs: int, train_size: int) -> int:
        """Global steps (batches of all ranks together) of a run of ``epochs``: every
        world size plans the same count, so the schedule is read at the same places."""
        return max(1, epochs * (train_size // self.batch_size))

    @property
    def schedules_lr(self) -> bool:
        """Whether the job sets the LR itself (``lr_schedule`` or ``lr_at``); False: the
        optimizer's own LR is the base."""
        return self.lr_schedule is not None or self.lr_at is not None

    def lr(self, step: int, planned_steps: int) -> float | None:
        """The job's LR at global ``step`` of a run planned for ``planned_steps``; None
        when the job gives no schedule (the optimizer's own LR is the base)."""
        if self.lr_schedule is not None:
            return self.lr_schedule(step, planned_steps)
        if self.lr_at is not None:
            return self.lr_at(step)
        return None


#: Where ``request_eval``/``request_checkpoint`` send their Intent: set by the rank on
#: its training thread, the thread that runs the job's callbacks.
_intents = threading.local()


def bind_intents(send: Callable[[IntentKind], None] | None) -> None:
    """Route this thread's ``request_eval``/``request_checkpoint`` to ``send`` (the rank
    does this; None unbinds)."""
    _intents.send = send


def _request(kind: IntentKind, name: str) -> None:
    send: Callable[[IntentKind], None] | None = getattr(_intents, "send", None)
    if send is None:
        raise RuntimeError(
            f"{name}() called outside a rank's training thread; call it from the job's "
            "callbacks (loss_fn, epoch_fn, metrics_fn, eval_result_fn) while a rank runs"
        )
    send(kind)


def request_eval() -> None:
    """Ask for an eval of the consensus (flodl's cooperative ``Intent(EvalNow)``).

    Call it from the job's code on any rank: the coordinator folds it into its next
    averaging round, whose consensus the eval role rank scores; the result comes back
    through ``eval_result_fn`` and the run's metrics like a scheduled eval.
    """
    _request(IntentKind.EVAL_NOW, "request_eval")


def request_checkpoint() -> None:
    """Ask for a checkpoint (flodl's cooperative ``Intent(CheckpointNow)``): at the next
    epoch boundary the checkpoint role rank runs ``checkpoint_fn`` (and, with
    ``--save-path``, a resumable save is armed), as for ``--checkpoint-every``."""
    _request(IntentKind.CHECKPOINT_NOW, "request_checkpoint")


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """torch.distributed's default group as the bus set it up for the job's own code
    (``--user-group``, on by default): what ``process_group()`` returns."""

    #: this rank's place in the group (``dist.get_rank()``); after a re-form it may
    #: differ from ``bus_rank``
    rank: int
    world_size: int
    #: ``gloo`` on a CPU, ``nccl`` on a GPU
    backend: str
    #: 0 for the group the run started with, one more at each re-form after a death
    generation: int
    #: the rank's id in the run (``RANK``), the same for the whole run
    bus_rank: int


#: The default group of this process, set by the rank that formed it (None: none formed
#: by the bus, e.g. ``--user-group false``, or between a destroy and the next form).
_group: list[GroupInfo | None] = [None]


def bind_process_group(info: GroupInfo | None) -> None:
    """Record the default group the rank just formed (None: it is gone)."""
    _group[0] = info


def process_group() -> GroupInfo | None:
    """The default group the bus formed for the job's code, or None when it did not.

    Compare ``generation`` with the one a collective of yours last ran on to see that
    the group was re-formed after a death (new ranks, smaller world) in between.
    """
    return _group[0]


def load_job(ref: str) -> Job:
    """Resolve ``MODULE:NAME`` to a Job; a clear one-line error names the fix."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"--job {ref!r}: expected MODULE:NAME, e.g. flodl_bus.examples.digits:job")
    # The job's own folder is importable, as `python -m` makes it: `--job myjob:job` run
    # from the folder of myjob.py works without PYTHONPATH=. (appended: an installed
    # package of the same name still wins).
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    # A relative name ('.mod') makes import_module raise TypeError, not ImportError.
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError) as exc:
        raise SystemExit(
            f"--job {ref!r}: cannot import {module_name} ({exc}); "
            "use an absolute module name that is installed or on PYTHONPATH"
        ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise SystemExit(
            f"--job {ref!r}: {module_name} has no attribute {attr!r}; "
            "name a Job (or a zero-argument function returning one) defined there"
        ) from None
    if callable(obj) and not isinstance(obj, Job):
        # Calling a factory that needs arguments would escape as a bare TypeError.
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise SystemExit(
                f"--job {ref!r}: {attr} takes arguments; "
                "point --job at a Job or a zero-argument function returning one"
            ) from None
        except ValueError:
            pass  # no introspectable signature: just call it
        try:
            obj = obj()
        except Exception as exc:
            # One line, not the factory's traceback from every process; the cause stays
            # chained for a caller that shows tracebacks (``--log-level debug``).
            raise SystemExit(f"--job {ref!r}: {attr}() raised {describe_error(exc)}") from exc
    if not isinstance(obj, Job):
        raise SystemExit(
            f"--job {ref!r}: {attr} is a {type(obj).__name__}, not a flodl_bus Job; "
            "point --job at a Job or a zero-argument function returning one"
        )
    return obj


class _Described(BaseException):
    """Carries the job a script's ``Rank(...)`` describes out of the script's run (a
    BaseException, so the script's own ``except Exception`` does not swallow it)."""

    def __init__(self, job: Job) -> None:
        super().__init__(job.name)
        self.job = job


#: Whether ``describe_script`` is reading a script on this thread.
_describing = threading.local()


def offer_script_job(job: Job) -> None:
    """What a script's ``Rank(...)`` calls with the job its arguments make: while the
    coordinator reads the script (``describe_script``) the script's run ends here with
    that job; in a rank this returns and the rank goes on to join the run."""
    if getattr(_describing, "on", False):
        raise _Described(job)


def describe_script(path: str, argv: Sequence[str]) -> Job:
    """The job of a training script that keeps its own loop: the script is run as
    ``python PATH ARGV...`` would run it, up to its ``flodl_bus.Rank(...)``, whose
    arguments (model, optimizer, data, batch size, epochs...) make the job. The
    coordinator needs only its sizes, so nothing of the script after ``Rank(...)`` runs
    here. One-line errors: a script that is missing, raises, or never makes a Rank."""
    import runpy

    if not os.path.isfile(path):
        raise SystemExit(f"--script {path!r}: no such file")
    where = os.path.dirname(os.path.abspath(path))
    saved_argv, saved_path = sys.argv, list(sys.path)
    # As `python PATH` runs it: its own folder importable first, its arguments in argv.
    sys.argv = [path, *argv]
    sys.path.insert(0, where)
    _describing.on = True
    try:
        runpy.run_path(path, run_name="__main__")
    except _Described as described:
        return described.job
    except SystemExit as exc:
        raise SystemExit(
            f"--script {path!r}: it exited ({exc.code}) before making its flodl_bus.Rank"
        ) from None
    except Exception as exc:
        raise JobError(f"the script raised {describe_error(exc)}") from exc
    finally:
        _describing.on = False
        sys.argv = saved_argv
        sys.path[:] = saved_path
    raise SystemExit(
        f"--script {path!r}: it ended without making a flodl_bus.Rank; "
        "wrap its training loop in `with flodl_bus.Rank(model, optimizer, data, ...) as rank:`"
    )
