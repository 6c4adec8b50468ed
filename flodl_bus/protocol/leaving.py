"""Why a rank leaves mid-run: the kinds an ``Exiting.reason`` names.

``Exiting.reason`` is free text for a person (``"SIGTERM"``), so the kinds the
coordinator must tell apart are a prefix of it, ``"<kind>: <detail>"``. A reason without
a known kind is a rank leaving on its own (a signal, a crash): the coordinator declares
it dead at once. A job failure is different: the job's code is the same on every rank,
so a bug one rank hit, every rank will hit; the coordinator stops the whole run
(``ShutdownWithSave(JOB_FAILED)``) instead of re-forming the survivors around it.
"""

from __future__ import annotations

from typing import Final

#: The job's own code failed (a builder, ``loss_fn``, ``eval_fn`` raised, or a non-finite
#: loss under ``on_nonfinite_loss="stop"``): the run stops.
JOB_FAILED: Final = "job_failed"
#: The rank's averaging round failed for good (its group broke and no new session came):
#: the coordinator declares the rank dead, the survivors re-form.
AVERAGING_FAILED: Final = "averaging_failed"
#: A rank's own runtime failed (not the job's code): declared dead at once.
RANK_FAILED: Final = "rank_failed"
#: The rank was set up wrong (a resume whose saved state does not fit this job): no
#: rank can go on either, so the run stops without a save (which would overwrite the
#: checkpoint) and every process exits with the config code.
CONFIG_ERROR: Final = "config_error"

#: Detail beyond this is cut: the reason is one console line, the traceback lives in the
#: rank's log.
MAX_DETAIL: Final = 400


def reason(kind: str, detail: str) -> str:
    """The ``Exiting.reason`` for a rank leaving because of ``kind``."""
    detail = " ".join(detail.split())  # one line, whatever the exception text held
    if len(detail) > MAX_DETAIL:
        detail = detail[: MAX_DETAIL - 1] + "…"
    return f"{kind}: {detail}"


def kind_of(text: str | None) -> str | None:
    """The kind of an ``Exiting.reason`` (None for a reason without a known kind)."""
    if text is None:
        return None
    head, sep, _ = text.partition(":")
    return head if sep and head in _KINDS else None


def detail_of(text: str) -> str:
    """The part of a reason after its kind (the whole text when it has none)."""
    return text.partition(": ")[2] if kind_of(text) is not None else text


_KINDS: Final = frozenset({JOB_FAILED, AVERAGING_FAILED, RANK_FAILED, CONFIG_ERROR})
