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
    "worker": ("flodl_bus.worker.cli:main", "run one rank (or join a run without --rank)"),
    "tail": ("flodl_bus.bus.tail:main", "print a run's control and upstream entries live"),
    "replay": ("flodl_bus.record.replay:main", "replay a recorded run against fresh cores"),
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
}


def _usage() -> str:
    lines = ["usage: flodl-bus COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  bench {name:<6} {help_}" for name, (_, help_) in BENCHES.items()]
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
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(_usage(), file=sys.stderr)
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
