"""One rank of a multi-process param-plane test: ``python -m tests.params.rank_worker``.

argv: SCENARIO REDIS_URL RUN_ID RANK WORLD_SIZE ARGS_JSON. The last stdout line is a JSON
object with what the rank observed; the parent test asserts on it. Control from the parent
(a stand-in for the coordinator's ``NewNcclSession``/``DeclareDead``) arrives on the Redis
list ``test:{RUN_ID}:ctl:<rank>`` and is applied by a thread, as the rank's control reader
would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import sys
import threading
import time
from typing import Any

import redis
import torch
from torch import nn

from flodl_bus.params.flat import FlatBuffers
from flodl_bus.params.plane import ParamConfig, TorchParamPort
from flodl_bus.protocol.messages import AveragedParams, Shutdown, SyncAck, Update


class Toy(nn.Module):
    """Two parameters, an f32 buffer (averaged over movers) and an int buffer (local)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(1))
        self.register_buffer("running", torch.zeros(1))
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64))


def set_values(model: Toy, case: dict[str, Any]) -> None:
    with torch.no_grad():
        model.w.copy_(torch.tensor(case["w"], dtype=torch.float32))
        model.b.copy_(torch.tensor(case.get("b", [0.0]), dtype=torch.float32))
        model.running.copy_(torch.tensor(case.get("running", [0.0])))
        model.count.copy_(torch.tensor(case.get("count", [0])))


def observe(model: Toy) -> dict[str, Any]:
    return {
        "w": [_num(x) for x in model.w.tolist()],
        "b": [_num(x) for x in model.b.tolist()],
        "running": model.running.tolist(),
        "count": model.count.tolist(),
    }


def _num(x: float) -> float | str:
    return "nan" if math.isnan(x) else x


def control_thread(r: redis.Redis, run_id: str, rank: int, port: TorchParamPort) -> None:
    key = f"test:{run_id}:ctl:{rank}"
    while True:
        got = r.blpop([key], timeout=1)
        if got is None:
            continue
        cmd = json.loads(got[1])
        if cmd["op"] == "abort":
            port.abort()
        elif cmd["op"] == "session":
            port.new_session(bytes.fromhex(cmd["uid"]), cmd["rank"], cmd["world"])
        elif cmd["op"] == "stop":
            return


def scenario_sync(port: TorchParamPort, model: Toy, rank: int, args: dict[str, Any]) -> Any:
    out = []
    resets = [0]

    def reset_inner() -> None:  # what the rank's optimizer reset would be told
        resets[0] += 1

    port.reset_inner = reset_inner
    for case in args["cases"]:
        mine = case["ranks"][rank]
        set_values(model, mine)
        if "gamma" in case:
            assert port._sync is not None
            port._sync.gamma = case["gamma"]
        pre = observe(model)
        res = port.sync_now(mine["steps"])
        out.append(
            {
                "pre": pre,
                "post": observe(model),
                "consensus": _consensus(port),
                "triple": list(_triple(res)),
                "inner_resets": resets[0],
            }
        )
    return out


def _consensus(port: TorchParamPort) -> dict[str, Any] | None:
    got = port.consensus()
    if got is None:
        return None
    (w, _b), (running,) = got
    return {"w": w.tolist(), "running": running.tolist()}


def _triple(res: Any) -> tuple[Any, Any, Any]:
    return (res.divergence, res.post_norm, res.pre_norm)


def scenario_cpu(
    port: TorchParamPort,
    model: Toy,
    rank: int,
    args: dict[str, Any],
    control: queue.Queue[Any],
    events: list[str],
) -> Any:
    out = []
    cpu = port.cpu
    assert cpu is not None
    for case in args["cases"]:
        mine = case["ranks"][rank]
        set_values(model, mine)
        port.easgd_alpha = case.get("easgd_alpha")
        port.config = dataclasses.replace(
            port.config, keep_round_steps=case.get("keep_round_steps", False)
        )
        time.sleep(mine.get("delay", 0.0))
        pre = observe(model)
        t0 = time.monotonic()
        port.snapshot(mine["steps"])
        returned_s = time.monotonic() - t0
        if "train_to" in mine:  # training goes on while the round runs
            with torch.no_grad():
                model.w.fill_(mine["train_to"])
        msg = control.get(timeout=30)
        assert isinstance(msg, Update), msg
        before_load = observe(model)
        port.load_averaged(msg.avg)
        # the ack follows the Update (the triple is computed after the injection)
        deadline = time.monotonic() + 30
        while sum(e.startswith("publish:SyncAck") for e in events) <= len(out):
            assert time.monotonic() < deadline, "no SyncAck after the Update"
            time.sleep(0.005)
        ack = next(e for e in reversed(events) if e.startswith("publish:SyncAck"))
        out.append(
            {
                "pre": pre,
                "before_load": before_load,
                "post": observe(model),
                "consensus": _consensus(port),
                "realized": msg.avg.realized,
                "version": msg.avg.version,
                "ack": json.loads(ack.split(" ", 1)[1]),
                "snapshot_returned_s": returned_s,
                "staging": [
                    list(cpu.snap.data_ptrs()),
                    list(cpu.cons.data_ptrs()),
                    list(cpu.snap_b.data_ptrs()),
                    list(cpu.cons_b.data_ptrs()),
                ],
                "allocations": FlatBuffers.allocations,
                "pinned": cpu.snap.pinned,
            }
        )
    bad = [len(msg.avg.params) + 1]
    try:
        port.load_averaged(AveragedParams(tuple(torch.zeros(1) for _ in range(bad[0])), (), 99))
        wrong_count = "accepted"
    except ValueError:
        wrong_count = "ValueError"
    return {"cases": out, "events": events, "wrong_count": wrong_count}


def scenario_rounds(
    port: TorchParamPort,
    model: Toy,
    rank: int,
    args: dict[str, Any],
    r: redis.Redis,
    run_id: str,
    control: queue.Queue[Any],
) -> Any:
    """Average every ``pause`` seconds; the parent kills or stops a peer meanwhile.

    ``nccl``: ``sync_now``; ``cpu``: ``snapshot`` then the injected ``Update`` (or
    ``Shutdown``). A failure ends the loop and is reported with how long it took.
    """
    durations: list[float] = []
    worlds = []
    error = None
    for rnd in range(args["rounds"]):
        set_values(model, {"w": [float(rank + 1) * (rnd + 1)] * 3})
        t0 = time.monotonic()
        try:
            if port.cpu is None:
                port.sync_now(1)
            else:
                port.snapshot(1)
                msg = control.get(timeout=120)
                if isinstance(msg, Shutdown):
                    raise RuntimeError("Shutdown injected")
                port.load_averaged(msg.avg)
                assert port.cpu.wait_idle(30)
        except Exception as exc:
            error = {"type": type(exc).__name__, "after_s": time.monotonic() - t0}
            break
        durations.append(time.monotonic() - t0)
        group = port.sessions.group
        assert group is not None
        worlds.append([group.rank, group.world_size, group.prefix])
        r.set(f"test:{run_id}:progress:{rank}", rnd + 1)
        time.sleep(args["pause"])
    return {"durations": durations, "worlds": worlds, "final": observe(model), "error": error}


def scenario_wire(
    port: TorchParamPort, model: Toy, rank: int, args: dict[str, Any], control: queue.Queue[Any]
) -> Any:
    """CPU rounds of given values (``args["rounds"][i][rank]``: w, b, running, steps), each
    adopted; per round the model after it (as exact floats) and the bytes the rank sent."""
    cpu = port.cpu
    assert cpu is not None
    out = []
    for rnd in args["rounds"]:
        mine = rnd[rank]
        set_values(model, mine)
        port.snapshot(mine["steps"])
        msg = control.get(timeout=30)
        assert isinstance(msg, Update), msg
        port.load_averaged(msg.avg)
        assert cpu.wait_idle(30)
        assert cpu.last is not None
        out.append({"post": observe(model), "wire_bytes": cpu.last.wire_bytes})
    return out


def main() -> None:
    scenario, url, run_id, rank_s, world_s, args_json = sys.argv[1:7]
    rank, world = int(rank_s), int(world_s)
    args = json.loads(args_json)
    torch.set_num_threads(1)
    r = redis.Redis.from_url(url, socket_timeout=5)
    model = Toy()
    control: queue.Queue[Any] = queue.Queue()
    events: list[str] = []
    lock = threading.Lock()

    def inject(msg: Any) -> None:
        with lock:
            events.append(f"inject:{type(msg).__name__}")
        control.put(msg)

    def publish(msg: Any) -> None:
        with lock:
            if isinstance(msg, SyncAck):
                body = [msg.divergence, msg.post_norm, msg.pre_norm, msg.rank, msg.step_count]
                events.append(f"publish:SyncAck {json.dumps(body)}")
            else:
                events.append(f"publish:{type(msg).__name__}")

    config = ParamConfig(
        backend=args.get("backend", "nccl"),
        outer=args.get("outer"),
        timeout=args.get("timeout", 10.0),
        mailbox_cap=args.get("mailbox_cap", 20.0),
        bf16_wire=args.get("bf16_wire", False),
    )
    port = TorchParamPort(
        list(model.parameters()),
        list(model.buffers()),
        redis_client=url,
        run_id=run_id,
        rank=rank,
        world_size=world,
        config=config,
        inject=inject,
        publish=publish,
    )
    threading.Thread(target=control_thread, args=(r, run_id, rank, port), daemon=True).start()
    result: Any
    if scenario == "sync":
        result = scenario_sync(port, model, rank, args)
    elif scenario == "cpu":
        result = scenario_cpu(port, model, rank, args, control, events)
    elif scenario == "wire":
        result = scenario_wire(port, model, rank, args, control)
    elif scenario == "rounds":
        result = scenario_rounds(port, model, rank, args, r, run_id, control)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps({"rank": rank, "result": result}), flush=True)
    if args.get("fast_exit"):
        # A group abandoned mid-op (frozen peer) is only destroyed once the op times
        # out; the test has what it needs and need not wait for that.
        os._exit(0)
    port.close()


if __name__ == "__main__":
    main()
