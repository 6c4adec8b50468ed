"""Stop signals handled by the process itself, one exit-code table, the launcher's
notices to the coordinator: the pieces, in one process (the end-to-end cases with real
processes are in ``tests/launch/test_signals.py``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from flodl_bus import exits
from flodl_bus.coordinator.supervisor import ChildExit, SupervisorFeed, notice
from flodl_bus.launch.up import run_exit_code
from flodl_bus.stop_signals import SignalStop, StopSignals


@pytest.fixture
def sigint_ignored() -> Iterator[None]:
    """This process as a background job of a script starts it: SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_during_setup_a_stop_signal_raises_even_when_it_was_inherited_ignored(
    sig: signal.Signals, sigint_ignored: None
) -> None:
    with StopSignals() as stop, pytest.raises(SignalStop) as raised:
        os.kill(os.getpid(), sig)
        for _ in range(1000):  # the handler runs between two bytecodes
            pass
    assert raised.value.signum == sig
    assert stop.exit_code == 128 + sig
    # The inherited disposition is back once the command returns.
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_once_running_a_stop_signal_calls_back_on_another_thread_and_counts_repeats() -> None:
    calls: list[tuple[int, int, str]] = []
    second = threading.Event()

    def on_stop(signum: int, nth: int) -> None:
        calls.append((signum, nth, threading.current_thread().name))
        if nth == 2:
            second.set()

    with StopSignals() as stop:
        stop.call_on_stop(on_stop)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert second.wait(10), calls
    # The first signal names the stop; the second is only counted (it hurries it).
    assert [(s, n) for s, n, _ in calls] == [(signal.SIGTERM, 1), (signal.SIGTERM, 2)]
    assert all(name == "stop-signals" for _, _, name in calls)
    assert stop.exit_code == 143


def test_a_signal_before_the_callback_is_acted_on_when_it_is_given() -> None:
    got = threading.Event()
    with StopSignals() as stop:
        with pytest.raises(SignalStop):
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(1000):
                pass
        stop.call_on_stop(lambda signum, nth: got.set())
        assert got.wait(10)


def test_the_exit_code_table() -> None:
    assert (exits.OK, exits.FAILED, exits.CONFIG, exits.STOPPED) == (0, 1, 2, 3)
    assert [exits.by_signal(s) for s in exits.STOP_SIGNALS] == [143, 130, 129]
    assert exits.describe(-9) == "killed by SIGKILL"
    assert exits.describe(143) == "stopped by SIGTERM (exit 143)"


@pytest.mark.parametrize(
    ("coordinator", "workers", "kw", "code"),
    [
        (0, [0, 0], {}, 0),
        (0, [0, 0], {"target_missed": True}, 1),
        # A rank killed by someone (SIGKILL: -9, which a shell shows as 247) while the
        # survivors finished: the run finished, not every process did.
        (0, [0, -9], {}, 1),
        (0, [0, 143], {}, 1),
        (3, [0, 3], {}, 3),  # ShutdownWithSave: stopped by the protocol
        (3, [1, 0], {}, 1),  # ...because the job raised on a rank: that is the cause
        (-9, [3, 3], {}, 1),  # the coordinator was killed: its ranks lost it
        (143, [0, 0], {}, 143),  # someone sent the coordinator SIGTERM
        (2, [None, None], {}, 2),
        (None, [None, None], {"signum": signal.SIGINT}, 130),
        (130, [130, 130], {"signum": signal.SIGHUP}, 129),
        (0, [0, 0], {"lingered": True}, 1),
    ],
)
def test_up_maps_its_childrens_outcomes_onto_the_table_and_never_leaks_a_raw_status(
    coordinator: int | None, workers: list[int | None], kw: dict[str, object], code: int
) -> None:
    assert run_exit_code(coordinator, workers, **kw) == code  # type: ignore[arg-type]


def test_the_supervisor_feed_hands_over_child_exits_and_reports_the_launcher_gone() -> None:
    r, w = os.pipe()
    gone = threading.Event()
    feed = SupervisorFeed(r, gone.set)
    os.write(w, notice(2, -9) + b"not json\n" + notice(1, 143)[:5])
    os.write(w, notice(1, 143)[5:])
    got: list[ChildExit] = []
    for _ in range(200):
        got += feed.take()
        if len(got) == 2:
            break
        gone.wait(0.01)
    assert got == [ChildExit(2, -9), ChildExit(1, 143)]
    assert not gone.is_set()
    os.close(w)  # the launcher died
    assert gone.wait(10)
