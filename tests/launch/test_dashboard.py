"""``flodl-bus dashboard``: the fold of a run's entries, the observer on Redis, the HTTP
server, and the page in a real headless Chromium during a real run."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from flodl_bus.bus import entries
from flodl_bus.bus.ids import format_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.launch.dashboard import Dashboard, Observer, is_loopback, main
from flodl_bus.launch.dashboard_page import PAGE
from flodl_bus.launch.dashboard_state import DashboardState
from flodl_bus.protocol.messages import (
    Batch,
    DeclareDead,
    EpochAggregated,
    EpochMetrics,
    EpochPlan,
    EvalBroadcast,
    Exiting,
    NewNcclSession,
    StartEpoch,
    SyncNow,
    WireUpdate,
)
from flodl_bus.protocol.signing import MacKey
from flodl_bus.record.log import read_records
from tests.launch.test_up import MARK, marked_pids

REPO = Path(__file__).resolve().parents[2]

NOW = 1_800_000_000_000


def _aggregate(epoch: int, loss: float = 0.5) -> EpochAggregated:
    return EpochAggregated(
        EpochMetrics(epoch=epoch, avg_loss=loss, epoch_ms=2000.0, per_rank_throughput=(3.0, 4.0))
    )


def _running(state: DashboardState, **fields: str) -> None:
    meta = {"status": "running", "world_size": "2", "epochs": "4", "mode": "cpu-cadence"}
    state.on_meta({**meta, **fields}, NOW)


# ------------------------------------------------------------------------- the fold
def test_an_epochs_rounds_are_counted_by_entry_id_whatever_order_the_streams_are_read_in() -> None:
    state = DashboardState("r")
    # ctl:all read first (its stream was found first), ctl:0's Updates after it
    state.on_control(None, (NOW + 100, 0), _aggregate(0))
    for ms, version in ((NOW + 50, 1), (NOW + 60, 2), (NOW + 150, 3)):
        state.on_control(0, (ms, 0), WireUpdate(version))
    snap = state.snapshot(NOW + 200)
    assert [row["rounds_total"] for row in snap["epoch_rows"]] == [2]
    assert snap["rounds"] == 3  # no meta: the wire's count


def test_nccl_rounds_count_broadcast_and_per_rank_sync_now_alike() -> None:
    state = DashboardState("r")
    state.on_control(None, (NOW + 1, 0), SyncNow())  # before any rank is known
    state.on_control(0, (NOW + 2, 0), SyncNow())
    state.on_control(1, (NOW + 3, 0), SyncNow())
    state.on_control(None, (NOW + 4, 0), _aggregate(0))
    snap = state.snapshot(NOW + 10)
    assert snap["rounds"] == 2 and snap["epoch_rows"][0]["rounds_total"] == 2


def test_the_eval_tagged_k_scores_epoch_k_minus_1_as_metrics_csv_numbers_it() -> None:
    state = DashboardState("r")
    state.on_control(None, (NOW, 0), _aggregate(0, loss=1.25))
    state.on_control(None, (NOW + 1, 0), EvalBroadcast(epoch=1, metric=0.75))
    state.on_control(None, (NOW + 2, 0), EvalBroadcast(epoch=2, metric=float("nan")))
    snap = state.snapshot(NOW + 10)
    assert snap["evals"] == [{"epoch": 0, "metric": 0.75}]
    (row,) = snap["epoch_rows"]
    assert (row["epoch"], row["loss"], row["eval"]) == (0, 1.25, 0.75)
    assert row["samples_per_s"] == [3000.0, 4000.0]  # the wire's samples/ms as /s


def test_a_death_and_its_reformation_are_one_event_each_naming_every_survivors_new_rank() -> None:
    state = DashboardState("r")
    _running(state, world_size="3")
    state.on_control(None, (NOW + 1, 0), DeclareDead(rank=1))
    state.on_control(0, (NOW + 2, 0), NewNcclSession(b"u1", new_rank=0, new_world_size=2))
    state.on_control(2, (NOW + 3, 0), NewNcclSession(b"u1", new_rank=1, new_world_size=2))
    state.on_upstream(2, (NOW + 4, 0), Exiting(rank=2, reason="stopped by the operator"))
    snap = state.snapshot(NOW + 10)
    assert [(e["kind"], e["text"]) for e in snap["events"]] == [
        ("death", "rank 1 declared dead by the coordinator"),
        ("reform", "re-formed: world of 2 (rank->new rank: 0->0, 2->1)"),
        ("exit", "rank 2 left: stopped by the operator"),
    ]
    assert [r["state"] for r in snap["ranks"]] == ["alive", "dead", "left"]


def test_a_ranks_step_loss_and_rate_come_from_its_batches_and_liveness_from_the_coordinator() -> (
    None
):
    state = DashboardState("r")
    _running(
        state,
        state_at=repr((NOW - 1000) / 1000),
        heard_s="[0.5, 3.0]",
        rank_epoch="[2, 1]",
        counts="[12, 9]",
        anchor="9",
        gate_open="0",
        gate_why="rank 1 at 4/9 steps",
        syncs="7",
    )
    for i in range(11):  # 11 steps over one second: 10 steps/s
        state.on_upstream(0, (NOW - 1000 + 100 * i, 0), Batch(0, 5.0, 1.0, 10 + i, 0.25))
    state.on_upstream(1, (NOW - 30_000, 0), Batch(1, 5.0, 1.0, 4, 0.5))  # long ago
    snap = state.snapshot(NOW)
    r0, r1 = snap["ranks"]
    assert (r0["step"], r0["loss"], r0["epoch"], r0["window"]) == (20, 0.25, 2, 12)
    assert r0["steps_per_s"] == pytest.approx(10.0)
    assert r0["heard_s"] == pytest.approx(1.5) and r1["heard_s"] == pytest.approx(4.0)
    assert r1["step"] == 4 and r1["steps_per_s"] is None  # nothing in the rate window
    assert snap["gate"] == {"open": False, "why": "rank 1 at 4/9 steps"}
    assert (snap["anchor"], snap["rounds"], snap["epoch"], snap["epochs"]) == (9, 7, 1, 4)


def test_a_finished_run_shows_every_epoch_done_and_no_gate_rate_or_heartbeat() -> None:
    state = DashboardState("r")
    state.on_upstream(0, (NOW - 100, 0), Batch(0, 5.0, 1.0, 1, 0.5))
    state.on_upstream(0, (NOW - 50, 0), Batch(0, 5.0, 1.0, 2, 0.5))
    state.on_control(0, (NOW - 40, 0), StartEpoch(EpochPlan(3, 0, 10)))
    state.on_meta(
        {"status": "finished", "world_size": "1", "epochs": "4", "gate_open": "0",
         "gate_why": "rank 0 at 1/9 steps", "heard_s": "[0.1]", "state_at": repr(NOW / 1000)},
        NOW,
    )  # fmt: skip
    snap = state.snapshot(NOW)
    assert snap["live"] is False and snap["gate"] is None and snap["epoch"] == 4
    (r0,) = snap["ranks"]
    assert (r0["state"], r0["steps_per_s"], r0["heard_s"], r0["epoch"]) == ("done", None, None, 3)


def test_the_runs_secret_never_reaches_a_snapshot() -> None:
    state = DashboardState("r")
    state.on_meta({"status": "running", "secret": "ab" * 16}, NOW)
    assert "ab" * 16 not in json.dumps(state.snapshot(NOW))


# --------------------------------------------------------------- the observer on Redis
def _xadd(client: Any, stream: str, ms: int, msg: object, rank: str, seq: int) -> None:
    eid = format_id((ms, 0))
    client.xadd(stream, entries.build(MacKey(b"k" * 32), stream, eid, msg, rank, seq), id=eid)


def test_the_observer_reads_every_stream_from_its_start_and_writes_nothing() -> None:
    # ids from the clock: one beyond any writer's clock would be taken for a foreign one
    now = time.time_ns() // 1_000_000 - 10_000
    client = fakeredis.FakeRedis()
    keys = RunKeys("obs")
    client.hset(keys.meta, mapping={"status": "running", "world_size": "2"})
    _xadd(client, keys.up(0), now, Batch(0, 5.0, 1.0, 7, 0.125), "0", 1)
    _xadd(client, keys.ctl_all, now + 1, DeclareDead(rank=1), "all", 1)
    client.xadd(keys.up(1), {b"type": b"Batch", b"junk": b"1"}, id=format_id((now + 2, 0)))
    client.xadd(
        keys.dlq,
        entries.dead_letter_fields(keys.up(1), "5-0", "authentication failed: bad mac", {}, "c"),
        id=format_id((now + 3, 0)),
    )
    before = {k: client.xlen(k) for k in (keys.up(0), keys.up(1), keys.ctl_all, keys.dlq)}
    observer = Observer(client, "obs")
    observer.step(block_ms=None)
    snap = observer.snapshot()
    assert snap["ranks"][0]["step"] == 7 and snap["ranks"][0]["loss"] == 0.125
    assert snap["ranks"][1]["state"] == "dead"
    assert snap["unreadable"] == 1  # the entry with bad fields is counted, not shown
    assert snap["dead_letters"]["count"] == 1
    assert snap["dead_letters"]["recent"][0]["reason"] == "authentication failed: bad mac"
    assert {k: client.xlen(k) for k in before} == before
    for k in before:
        assert client.xinfo_groups(k) == []  # no consumer group taken or made


def test_redis_going_away_is_said_on_the_page_and_the_observer_reads_on_when_it_is_back() -> None:
    # A real server, stopped under the observer (as Ctrl-C stops up's embedded Redis
    # while the dashboard still reads): the thread used to die with a traceback.
    import redis

    from flodl_bus.bus.server import RedisServer

    server = RedisServer().start()
    port = server.port
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    keys = RunKeys("gone")
    client.hset(keys.meta, mapping={"status": "running", "world_size": "1"})
    observer = Observer(client, "gone")
    stop = threading.Event()
    reader = threading.Thread(target=observer.run, args=(stop,), daemon=True)
    reader.start()
    try:
        server.stop()
        with observer.cond:
            assert observer.cond.wait_for(lambda: observer.trouble is not None, timeout=30)
        assert observer.snapshot()["trouble"].startswith("Redis unreachable (ConnectionError")
        assert reader.is_alive()
        server = RedisServer(port=port).start()  # back, empty: the trouble clears
        with observer.cond:
            assert observer.cond.wait_for(lambda: observer.trouble is None, timeout=30)
        assert reader.is_alive()
    finally:
        stop.set()
        reader.join(timeout=10)
        server.stop()
    assert not reader.is_alive()


# ------------------------------------------------------------------ the HTTP server
@pytest.fixture
def served() -> Iterator[tuple[Dashboard, str]]:
    client = fakeredis.FakeRedis()
    keys = RunKeys("served")
    client.hset(keys.meta, mapping={"status": "running", "world_size": "1", "mode": "cpu-sync"})
    _xadd(client, keys.up(0), time.time_ns() // 1_000_000, Batch(0, 5.0, 1.0, 3, 0.5), "0", 1)
    dash = Dashboard(client, "served")
    url = dash.start()
    try:
        yield dash, url
    finally:
        dash.close()


def _get(url: str, host: str | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, headers={} if host is None else {"Host": host})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, "", exc.read()


def test_the_server_binds_loopback_by_default_and_serves_the_page_and_the_state(
    served: tuple[Dashboard, str],
) -> None:
    _dash, url = served
    assert url.startswith("http://127.0.0.1:") and is_loopback("127.0.0.1")
    code, kind, body = _get(url)
    assert code == 200 and kind.startswith("text/html") and body.decode() == PAGE
    code, kind, body = _get(url + "state")
    state = json.loads(body)
    assert code == 200 and kind == "application/json"
    assert (state["run"], state["mode"], state["ranks"][0]["step"]) == ("served", "cpu-sync", 3)
    assert _get(url + "nothing")[0] == 404


def test_on_loopback_a_request_naming_another_host_is_refused(
    served: tuple[Dashboard, str],
) -> None:
    _dash, url = served
    port = url.rstrip("/").rsplit(":", 1)[1]
    assert _get(url + "state", host=f"attacker.example:{port}")[0] == 403
    assert _get(url + "state", host=f"localhost:{port}")[0] == 200  # an SSH tunnel's name


def test_the_event_stream_sends_a_snapshot_at_once(served: tuple[Dashboard, str]) -> None:
    _dash, url = served
    with urllib.request.urlopen(url + "events", timeout=10) as resp:
        assert resp.headers.get("Content-Type") == "text/event-stream"
        line = resp.readline()
    assert line.startswith(b"data: ") and json.loads(line[6:])["run"] == "served"


def test_the_page_fetches_nothing_from_any_other_address() -> None:
    # Only same-origin paths; the one URL in it is the SVG namespace, which is no fetch.
    assert "src=" not in PAGE and "href=" not in PAGE and "@import" not in PAGE
    assert [u for u in PAGE.split('"') if u.startswith("http")] == ["http://www.w3.org/2000/svg"]
    assert "innerHTML" not in PAGE  # values from the run go in as text only


@pytest.mark.redis
def test_a_run_that_is_not_there_is_one_line_and_exit_2(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--run", "never-there", "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flodl-bus dashboard: no run 'never-there'")


# ------------------------------------------------- a real run in a real headless browser
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: the page as a person reads it: each card's text, the rank and epoch tables by column
READ_PAGE = """
const text = (id) => document.getElementById(id).textContent;
const table = (id) => [...document.querySelectorAll("#" + id + " tbody tr")].map((tr) =>
  Object.fromEntries([...tr.cells].map((td) => [td.className.split(" ")[0], td.textContent])));
return {
  status: text("status"), epoch: text("epoch"), anchor: text("anchor"), rounds: text("rounds"),
  gate: text("gate"), dlq: text("dlq-count"), world: text("world"), last_eval: text("last-eval"),
  ranks: table("ranks"), epochs: table("epochs"),
  evals: [...document.querySelectorAll("#eval-chart circle")].map(
    (c) => [Number(c.dataset.epoch), Number(c.dataset.value)]),
};
"""


@pytest.fixture
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-default-apps", "--disable-domain-reliability",
        # Loopback only: every other host is unresolvable and any other request goes to
        # a closed loopback port (the browser's own loopback requests go direct).
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        "--proxy-server=127.0.0.1:9",
    ):  # fmt: skip
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def mark() -> Iterator[str]:
    token = uuid.uuid4().hex
    yield token
    for pid in marked_pids(token):  # whatever the outcome, leave nothing running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start(tmp_path: Path, mark: str, *argv: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLODL_RUN_SECRET"}
    env[MARK] = mark
    # the run's job lives in tests/ (tests.e2e.jobs), found from the repository root
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.Popen(
        [sys.executable, "-m", "flodl_bus.cli", *argv],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _close(rel: float) -> Any:
    return lambda shown, want: shown == pytest.approx(want, rel=rel)


@pytest.mark.slow
@pytest.mark.redis
def test_the_page_in_headless_chromium_shows_a_live_run_and_ends_matching_its_records(
    tmp_path: Path, redis_url: str, real_redis: Any, browser: Any, mark: str
) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    run, epochs = "dash-browser", 8
    keys = RunKeys(run)
    up = _start(
        tmp_path, mark, "up", "--no-progress", "--no-plot", "--redis-url", redis_url,
        "--run", run, "--workers", "2", "--epochs", str(epochs),
        "--job", "tests.e2e.jobs:slow_job",
    )  # fmt: skip
    dash: subprocess.Popen[str] | None = None
    try:
        # The command wants a run that exists: it does once the coordinator wrote meta.
        deadline = time.monotonic() + 120
        while not real_redis.exists(keys.meta):
            assert up.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        dash = _start(tmp_path, mark, "dashboard", "--run", run, "--redis-url", redis_url,
                      "--port", "0")  # fmt: skip
        assert dash.stdout is not None
        first = dash.stdout.readline()
        assert f"flodl-bus dashboard: run {run} at http://127.0.0.1:" in first, first
        url = first.split(" at ", 1)[1].split()[0]
        browser.get(url)

        # Live: both ranks stepping, the gate and the anchor from the coordinator.
        def live(driver: Any) -> Any:
            page = driver.execute_script(READ_PAGE)
            ranks = page["ranks"]
            ready = (
                page["status"] == "running"
                and len(ranks) == 2
                and page["gate"] != "-"
                and page["anchor"] != "-"
                and all(r["step"] != "-" and r["steps-per-s"] != "-" for r in ranks)
                and all(r["window"] != "-" and r["heard"] != "-" for r in ranks)
            )
            return page if ready else None

        # "running" is the coordinator's word in meta: the page saw the run while it ran
        page = WebDriverWait(browser, 180, poll_frequency=0.1).until(live)
        assert page["world"] == "2" and page["epoch"].endswith(f"/{epochs}")
        assert int(page["anchor"]) >= 1
        assert page["gate"] == "open" or (
            page["gate"].startswith("shut: ") and len(page["gate"]) > len("shut: ")
        )
        for r in page["ranks"]:
            assert r["state"] == "alive" and int(r["step"]) >= 1 and int(r["window"]) >= 1
            assert float(r["steps-per-s"]) > 0 and float(r["heard"].rstrip("s")) < 30

        out, _ = up.communicate(timeout=240)
        assert up.returncode == 0, out
        run_dir = tmp_path / "runs" / run
        rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
        evals = [(int(r["epoch"]), float(r["eval_metric"])) for r in rows if r["eval_metric"]]
        summary = read_records(run_dir / "up.jsonl")[-1]
        assert summary["event"] == "summary" and len(rows) == epochs and evals

        # Over: what the page ends with is what the run's records say.
        def over(driver: Any) -> Any:
            page = driver.execute_script(READ_PAGE)
            done = (
                page["status"] == "finished"
                and len(page["epochs"]) == len(rows)
                and len(page["evals"]) == len(evals)
                and page["rounds"] == str(summary["syncs"])
            )
            return page if done else None

        page = WebDriverWait(browser, 60, poll_frequency=0.1).until(over)
        assert page["epoch"] == f"{epochs}/{epochs}" and page["gate"] == "-"
        for shown, row in zip(page["epochs"], rows, strict=True):
            assert shown["epoch"] == row["epoch"]
            assert _close(1e-5)(float(shown["loss"]), float(row["avg_loss"]))
            assert shown["rounds"] == row["syncs_total"]
            per_rank = [float(x) for x in shown["samples-per-s"].split()]
            want = [float(row[f"samples_per_s_r{r}"]) for r in range(2)]
            assert per_rank == pytest.approx(want, rel=1e-3)
            assert shown["skipped"] == row["skipped_batches"]
            if row["eval_metric"]:
                assert _close(1e-5)(float(shown["eval"]), float(row["eval_metric"]))
            else:
                assert shown["eval"] == "-"
        assert [e for e, _ in page["evals"]] == [e for e, _ in evals]
        assert [m for _, m in page["evals"]] == pytest.approx([m for _, m in evals], rel=1e-5)
        final = summary["final_metric"]
        assert isinstance(final, float) and _close(1e-5)(float(page["last_eval"].split()[0]), final)
        assert sum(int(r["step"]) for r in page["ranks"]) == summary["batches"]
        assert [r["state"] for r in page["ranks"]] == ["done", "done"]
        assert page["dlq"] == str(real_redis.xlen(keys.dlq)) == "0"
    finally:
        for proc in (up, dash):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        if dash is not None:
            dash.wait(timeout=30)
        up.wait(timeout=60)
    assert dash.returncode == 0  # Ctrl-C is how a dashboard ends


@pytest.mark.slow
@pytest.mark.redis
def test_up_with_dashboard_prints_a_loopback_url_that_serves_the_run_until_up_ends(
    tmp_path: Path, redis_url: str, mark: str
) -> None:
    run = "dash-up"
    up = _start(
        tmp_path, mark, "up", "--no-progress", "--no-plot", "--redis-url", redis_url,
        "--run", run, "--workers", "2", "--epochs", "4", "--job", "tests.e2e.jobs:slow_job",
        "--dashboard",
    )  # fmt: skip
    try:
        assert up.stdout is not None
        said = [up.stdout.readline() for _ in range(3)]
        assert said[2].startswith("  dashboard: http://127.0.0.1:"), said
        url = said[2].split(": ", 1)[1].strip()
        deadline = time.monotonic() + 180
        while True:  # until the page's state shows both ranks stepping
            state = json.loads(_get(url + "state")[2])
            if state["status"] == "running" and all(r["step"] for r in state["ranks"]):
                break
            assert up.poll() is None and time.monotonic() < deadline, state
            time.sleep(0.1)
        assert (state["run"], state["world_size"], state["epochs"]) == (run, 2, 4)
        out, _ = up.communicate(timeout=240)
        assert up.returncode == 0, out
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)
    with pytest.raises(urllib.error.URLError):  # the page ends with the run
        _get(url + "state")
