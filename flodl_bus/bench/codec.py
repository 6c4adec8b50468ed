"""``flodl-bus bench codec``: what the wire costs per message, beside plain msgpack.

For each wire variant the same map is timed two ways in the same run: through
``wire.encode`` / ``wire.decode_*`` (named fields, schema version, full validation) and
through bare ``msgspec.msgpack.encode`` / ``decode`` of the generic map (the floor no
codec can beat). The
figure that matters is the ratio; absolute times depend on the machine.

``--signing 8,64,1024`` times a broadcast's signature and a rank's check of it instead,
beside the one-shot ``hmac.digest`` per rank slot that the prepared pads replaced.
"""

from __future__ import annotations

import argparse
import hmac
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from flodl_bus.protocol import messages as m
from flodl_bus.protocol import wire
from flodl_bus.protocol.signing import (
    VECTOR_MAX_RANKS,
    VECTOR_TAG,
    CoordinatorKeys,
    fixed_keys,
    rank_keys_for,
    signed_bytes,
)

_NCCL_UID = bytes(range(128))  # an NCCL unique id is 128 bytes


def sample_messages() -> dict[str, object]:
    """One realistic message per wire type (4 ranks where a message is per-rank).

    The tests reuse these as the valid corpus the fuzz loop mutates, so every field,
    including optional and nested ones, is populated here.
    """
    plan = m.EpochPlan(epoch=3, partition_offset=1024, partition_size=512)
    metrics = m.EpochMetrics(
        epoch=3,
        avg_loss=0.4213,
        epoch_ms=5321.5,
        scalars={"accuracy": 0.91, "grad_norm": 1.7},
        per_rank=tuple({"accuracy": 0.9 + r / 100, "grad_norm": 1.5 + r} for r in range(4)),
        per_rank_throughput=(101.5, 99.0, 97.25, 50.0),
        per_rank_batch_share=(0.27, 0.26, 0.26, 0.21),
        per_rank_share_complete_ms=(5100.0, 5200.0, 5250.0, 5321.5),
        per_rank_compute_only_ms=(4800.0, 4850.0, 4900.0, 5000.0),
        per_rank_data_starve_ms=(12.0, 15.5, 9.0, 30.25),
        device_indices=(0, 1, 2, 3),
        per_rank_loss=(0.41, 0.42, None, 0.43),
        per_rank_samples=(4096, 4000, 3968, 3200),
        per_rank_resources=(
            m.ResourceSample(rss_bytes=1_843_200_000),
            None,
            m.ResourceSample(rss_bytes=1_900_000_000, device_index=2, gpu_util_percent=55.5),
            m.ResourceSample(),
        ),
    )
    msgs: list[object] = [
        m.RequestParams(),
        m.WireUpdate(version=17, next_plan=plan),
        m.StageAdvisory(
            counts=(120, 118, 121, 60),
            segments=((3, ((0, 512), (2048, 256))), (4, ((512, 512),))),
        ),
        m.SyncNow(),
        m.StartEpoch(plan=plan),
        m.DeclareDead(rank=2),
        m.NewNcclSession(uid_bytes=_NCCL_UID, new_rank=1, new_world_size=3),
        m.RequestNewNcclId(),
        m.ShutdownWithSave(reason=m.SaveReason.REDUCE_STALL),
        m.ExtendPartition(partition_offset=4096, partition_size=256),
        m.Throttle(),
        m.SetGlobalStep(global_step=123_456),
        m.Checkpoint(version=9, target_rank=0),
        m.ExecuteEvalCallback(schedule_id=4, epoch=3, target_rank=1, adopt_consensus=True),
        m.ArmConsensusEval(schedule_id=4, epoch=3, target_rank=1),
        m.ArmEpochEval(schedule_id=4, epoch=3, target_rank=1),
        m.SetEpochCallbackRole(rank=0),
        m.Shutdown(),
        m.EpochAggregated(metrics=metrics),
        m.EvalBroadcast(epoch=3, metric=0.9375),
        m.SaveConsensusModel(target_rank=0),
        m.CoordHeartbeat(),
        m.Batch(
            rank=1,
            batch_ms=12.5,
            data_ms=0.75,
            step_count=4321,
            batch_loss=0.3875,
            param_norm=41.25,
            sync_divergence=0.0125,
        ),
        m.SyncAck(rank=1, step_count=4321, divergence=0.01, post_norm=41.0, pre_norm=41.5),
        m.Exiting(rank=1),
        m.LrUpdate(rank=1, lr=0.0003),
        m.Heartbeat(rank=1, step_count=4321),
        m.Intent(rank=1, kind=m.IntentKind.CHECKPOINT_NOW),
        m.SnapshotReady(rank=1),
        m.NewNcclIdGenerated(rank=0, uid_bytes=_NCCL_UID),
        m.EvalResult(
            rank=1, schedule_id=4, epoch=3, metric=0.9375, elapsed_ms=812.5, error="eval oom"
        ),
        m.CheckpointResult(rank=0, version=9, elapsed_ms=230.0, error=None),
        m.EpochFnElapsed(rank=0, epoch=3, elapsed_ms=15.5),
        m.MetricsMsg(
            rank=1,
            epoch=3,
            avg_loss=0.42,
            batches_processed=128,
            epoch_ms=5200.0,
            samples_processed=4096,
            share_complete_ms=5200.0,
            compute_only_ms=4850.0,
            data_starve_ms=15.5,
            scalars={"accuracy": (115.2, 128), "grad_norm": (217.6, 128)},
            resources=m.ResourceSample(
                rss_bytes=1_843_200_000,
                device_index=0,
                gpu_util_percent=87.0,
                vram_allocated_bytes=3_221_225_472,
                vram_reserved_peak_bytes=4_294_967_296,
                vram_total_bytes=25_769_803_776,
            ),
        ),
        m.Hello(
            worker_id="host-a:4121",
            host="host-a",
            dataset_sig="3f2a9c0e1b7d4a55",
            device="cuda:0",
            requested_rank=1,
        ),
        m.Assign(worker_id="host-a:4121", rank=1, world_size=4),
        m.Reject(worker_id="host-b:77", reason="dataset signature 9e0c... != 3f2a..."),
    ]
    return {wire.type_name(msg): msg for msg in msgs}


_DECODERS: dict[str, Callable[[bytes], Any]] = {
    wire.CONTROL: wire.decode_control,
    wire.UPSTREAM: wire.decode_upstream,
    wire.JOIN: wire.decode_join,
}


def _per_call_ns(fn: Callable[[Any], Any], arg: Any, iterations: int) -> float:
    clock = time.perf_counter_ns
    start = clock()
    for _ in range(iterations):
        fn(arg)
    return (clock() - start) / iterations


def measure(msg: object, iterations: int, repeats: int) -> dict[str, float]:
    """Median ns per call of wire encode/decode and the msgpack floor on the same map."""
    body = wire.encode(msg)
    as_map = wire.to_map(msg)
    channel = wire.channel_of(wire.type_name(msg))
    assert channel is not None
    decode = _DECODERS[channel]
    name = wire.type_name(msg)

    def typed(b: bytes) -> Any:
        # what a stream entry pays: its type field is known (the C path where one exists)
        return wire.decode(b, channel, name)

    samples: dict[str, list[float]] = {"enc": [], "dec": [], "typed": [], "pack": [], "unpack": []}
    # Interleave the four within each repeat so load from other processes hits all alike.
    for _ in range(repeats):
        samples["enc"].append(_per_call_ns(wire.encode, msg, iterations))
        samples["pack"].append(_per_call_ns(msgspec.msgpack.encode, as_map, iterations))
        samples["dec"].append(_per_call_ns(decode, body, iterations))
        samples["typed"].append(_per_call_ns(typed, body, iterations))
        samples["unpack"].append(_per_call_ns(msgspec.msgpack.decode, body, iterations))
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["bytes"] = float(len(body))
    return out


def _one_shot_vector(keys: CoordinatorKeys, data: bytes) -> bytes:
    """A broadcast MAC vector as it was made before the prepared pads: one
    ``hmac.digest`` (key set up again) and one hex conversion per rank. The reference."""
    ranks = keys.ranks
    return VECTOR_TAG + b"".join(
        hmac.digest(ranks[r].key, b"broadcast\x1f" + data, "sha256")[:8].hex().encode()
        for r in range(max(ranks) + 1)
    )


def measure_signing(ranks: int, iterations: int, repeats: int) -> dict[str, float]:
    """Median µs of one broadcast's signature over ``ranks`` and of one rank's check of
    it, beside the one-shot ``hmac.digest`` vector (the reference) in the same run."""
    keys = fixed_keys(b"bench-codec")
    for r in range(ranks):
        keys.rank(r)
    sample = sample_messages()["SetGlobalStep"]
    type_, body = wire.type_name(sample).encode(), wire.encode(sample)
    data = signed_bytes(b"flodl:{bench}:ctl:all", b"1796000000000-0", type_, b"all", b"7", body)
    signer = keys.broadcast
    checker = rank_keys_for(keys, ranks - 1).broadcast_verifier(ranks - 1)
    mac = signer.sign(data)
    vector = ranks <= VECTOR_MAX_RANKS
    if vector:
        assert mac == _one_shot_vector(keys, data)  # the same bytes, or no comparison

    def old_check(d: bytes) -> bool:
        got = hmac.digest(checker.rank_key.key, b"broadcast\x1f" + d, "sha256")[:8]
        return hmac.compare_digest(
            got.hex().encode(), mac[1 + 16 * (ranks - 1) : 17 + 16 * (ranks - 1)]
        )

    samples: dict[str, list[float]] = {"sign": [], "ref_sign": [], "check": [], "ref_check": []}
    for _ in range(repeats):
        samples["sign"].append(_per_call_ns(signer.sign, data, iterations) / 1000)
        samples["check"].append(
            _per_call_ns(lambda d: checker.verify(d, mac), data, iterations) / 1000
        )
        if vector:
            samples["ref_sign"].append(
                _per_call_ns(lambda d: _one_shot_vector(keys, d), data, iterations) / 1000
            )
            samples["ref_check"].append(_per_call_ns(old_check, data, iterations) / 1000)
    return {k: statistics.median(v) if v else float("nan") for k, v in samples.items()}


def _signing_report(counts: Sequence[int], iterations: int, repeats: int) -> None:
    print(
        "broadcast signing, median µs: the coordinator's signature of one broadcast and a "
        "rank's check of it; reference: one-shot hmac.digest per rank slot, same run"
    )
    for n in counts:
        r = measure_signing(n, max(1, iterations * 8 // max(n, 8)), repeats)
        kind = "MAC vector" if n <= VECTOR_MAX_RANKS else "Ed25519 (no vector above 64)"
        print(
            f"  {n:>5} ranks  {kind:<28} sign {r['sign']:8.1f} (ref {r['ref_sign']:8.1f})"
            f"   check {r['check']:6.1f} (ref {r['ref_check']:6.1f})"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flodl-bus bench codec",
        description="Median encode/decode ns per message vs plain msgpack on the same map.",
    )
    parser.add_argument(
        "--signing",
        default="",
        help="world sizes (e.g. 8,64,1024): time broadcast signing instead of the codec",
    )
    parser.add_argument("--iterations", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats (median is taken)")
    parser.add_argument("--only", nargs="*", default=None, help="wire type names to run")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.iterations < 1 or args.repeats < 1:
        parser.error("--iterations and --repeats must be at least 1")

    if args.signing:
        _signing_report(
            [int(x) for x in args.signing.split(",") if x], args.iterations, args.repeats
        )
        return 0
    samples = sample_messages()
    names = list(samples) if not args.only else args.only
    unknown = [n for n in names if n not in samples]
    if unknown:
        parser.error(f"unknown wire type(s): {', '.join(unknown)}")

    print(
        f"codec bench: {args.iterations} iterations x {args.repeats} repeats, "
        "median ns per message; floor = msgspec.msgpack encode/decode of the same map"
    )
    header = (
        f"{'type':<22}{'bytes':>6}  {'encode':>8}{'packb':>8}{'ratio':>7}"
        f"  {'decode':>8}{'unpackb':>8}{'ratio':>7}  {'typed':>8}{'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    enc_ratios: list[float] = []
    dec_ratios: list[float] = []
    typed_ratios: list[float] = []
    for name in names:
        r = measure(samples[name], args.iterations, args.repeats)
        enc_ratio = r["enc"] / r["pack"]
        dec_ratio = r["dec"] / r["unpack"]
        enc_ratios.append(enc_ratio)
        dec_ratios.append(dec_ratio)
        typed_ratio = r["typed"] / r["unpack"]
        typed_ratios.append(typed_ratio)
        print(
            f"{name:<22}{int(r['bytes']):>6}  {r['enc']:>8.0f}{r['pack']:>8.0f}{enc_ratio:>6.1f}x"
            f"  {r['dec']:>8.0f}{r['unpack']:>8.0f}{dec_ratio:>6.1f}x"
            f"  {r['typed']:>8.0f}{typed_ratio:>6.1f}x"
        )
    print(
        f"summary: {len(names)} variants; median ratio vs msgpack: "
        f"encode {statistics.median(enc_ratios):.2f}x (max {max(enc_ratios):.2f}x), "
        f"decode {statistics.median(dec_ratios):.2f}x (max {max(dec_ratios):.2f}x), "
        f"typed decode {statistics.median(typed_ratios):.2f}x (max {max(typed_ratios):.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
