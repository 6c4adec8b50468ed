"""``flodl-bus``: one entry point; each subcommand lives with the plane it drives.

Subcommand modules are imported lazily so ``flodl-bus tail`` does not pay for torch.
Each target is ``module:function`` taking the remaining argv and returning an exit code.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("flodl_bus.launch.up:main", "start Redis (embedded if no URL), coordinator and workers"),
    "coordinator": ("flodl_bus.coordinator.cli:main", "run the coordinator of a run"),
    "worker": ("flodl_bus.worker.options:main", "run one rank (or join a run without --rank)"),
    "status": (
        "flodl_bus.launch.status:main",
        "a live run: world, epoch, each rank's steps/s and heartbeat, gate, dead letters",
    ),
    "tail": ("flodl_bus.bus.tail:main", "print a run's control and upstream entries live"),
    "dashboard": (
        "flodl_bus.launch.dashboard:main",
        "a live web page of a run (loopback): ranks, gate, rounds, deaths, evals",
    ),
    "replay": ("flodl_bus.replay.cli:main", "replay a recorded run against fresh cores"),
    "events": (
        "flodl_bus.replay.events:main",
        "flodl's timeline of a recorded run: syncs, divergence, anchor, throttles",
    ),
    "acl": ("flodl_bus.bus.acl:main", "per-run Redis ACL users: create, drop, print rules"),
}

BENCHES: dict[str, tuple[str, str]] = {
    "codec": ("flodl_bus.bench.codec:main", "encode/decode cost per message vs plain msgpack"),
    "bus": ("flodl_bus.bench.bus:main", "dispatch latency, ingest rate, send cost vs PING"),
    "worker": ("flodl_bus.bench.worker:main", "training-thread bus cost per step"),
    "coordinator": ("flodl_bus.bench.coordinator:main", "coordinator cost per reduce/message"),
    "params": ("flodl_bus.bench.params:main", "CPU averaging round time vs memcpy"),
    "record": ("flodl_bus.bench.record:main", "recording cost per dispatch, replay speed"),
    "gpu": ("flodl_bus.bench.gpu:main", "pinned vs pageable copies, snapshot overlap"),
    "allreduce": ("flodl_bus.bench.allreduce:main", "SyncNow vs a bare all-reduce"),
    "train": ("flodl_bus.bench.train:main", "a training run under the bus vs plain loop and DDP"),
    "up": ("flodl_bus.bench.up:main", "flodl-bus up: time to first step, wall time"),
    "kill": ("flodl_bus.bench.kill:main", "kill a rank mid-epoch: time to the survivors' recovery"),
    "scale": ("flodl_bus.bench.scale:main", "N simulated ranks: epoch time, dispatch, CPU, memory"),
    "latency": ("flodl_bus.bench.latency:main", "ranks behind 0.5-10 ms RTT in namespaces"),
    "cluster": ("flodl_bus.bench.cluster:main", "the bus on a 3+3 Redis Cluster vs one Redis"),
    "path": ("flodl_bus.bench.path:main", "coordinator cost per message at N ranks vs budget"),
    "agent": ("flodl_bus.bench.agent:main", "coordinator upstream cost, host agents vs none"),
}


#: the help's sections, in order; every command is in exactly one (a test checks)
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train", ("up", "coordinator", "worker")),
    ("watch and inspect", ("status", "tail", "dashboard", "replay", "events")),
    ("operate", ("acl",)),
)


def version() -> str:
    from flodl_bus import __version__

    return __version__


def _usage() -> str:
    width = max(len(name) for name in [*COMMANDS, "bench NAME"]) + 2
    lines = [
        "usage: flodl-bus COMMAND [ARGS...]      flodl-bus COMMAND --help: its flags",
        "       flodl-bus --version",
    ]
    for title, names in GROUPS:
        lines += ["", f"{title}:"]
        lines += [f"  {name:<{width}}{COMMANDS[name][1]}" for name in names]
    lines += [
        f"  {'bench NAME':<{width}}measure a cost beside its reference "
        "(flodl-bus bench --help lists them)",
    ]
    return "\n".join(lines)


def _bench_usage() -> str:
    width = max(len(name) for name in BENCHES) + 2
    lines = ["usage: flodl-bus bench NAME [ARGS...]", "", "benches:"]
    lines += [f"  {name:<{width}}{help_}" for name, (_, help_) in BENCHES.items()]
    return "\n".join(lines)


def _load(target: str) -> Callable[[Sequence[str]], int]:
    module_name, func = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise SystemExit(f"flodl-bus: {module_name} is not available in this build") from None
        raise
    fn: Callable[[Sequence[str]], int] = getattr(module, func)
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        # No command is a mistake (exit 2, like argparse), not a request for help.
        print(_usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"flodl-bus {version()}")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0
        if not rest or rest[0] not in BENCHES:
            unknown = f"flodl-bus bench: unknown bench {rest[0]!r}\n\n" if rest else ""
            print(f"{unknown}{_bench_usage()}", file=sys.stderr)
            return 2
        return _load(BENCHES[rest[0]][0])(rest[1:])
    if cmd not in COMMANDS:
        print(f"flodl-bus: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    code = _load(COMMANDS[cmd][0])(rest)
    if cmd == "worker" and argv is None:
        _leave_now(code)
    return code


def _leave_now(code: int) -> None:
    """End a worker process without the interpreter's teardown.

    By now the rank has closed its records, its bus and its process groups. What is left
    is torch's and gloo's C++ state, whose destruction at exit can hit a thread still
    joinable and end a run that finished in ``std::terminate`` (exit -6, seen in about
    one gloo run in three on a loaded 2-core machine). Nothing of ours is lost by skipping
    it: the output streams and logging are flushed first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
