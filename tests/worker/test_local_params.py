"""LocalParams: the exact param plane of a world of one rank."""

from __future__ import annotations

import pytest
import torch

from flodl_bus.examples import digits
from flodl_bus.protocol.messages import AveragedParams, ControlMsg, SyncAck, Update, UpstreamMsg
from flodl_bus.worker.local_params import LocalParams, params_norm


def make() -> tuple[LocalParams, list[object]]:
    events: list[object] = []

    def inject(msg: ControlMsg) -> None:
        events.append(msg)

    def publish(msg: UpstreamMsg) -> None:
        events.append(msg)

    return LocalParams(digits.build_model(), inject=inject, publish=publish), events


def test_sync_now_of_one_rank_changes_nothing_and_reports_zero_divergence() -> None:
    lp, _ = make()
    before = [p.clone() for p in lp.model.parameters()]
    result = lp.sync_now(5)
    assert result.divergence == 0.0 and result.pre_norm == result.post_norm == params_norm(lp.model)
    assert all(torch.equal(a, b) for a, b in zip(before, lp.model.parameters()))


def test_snapshot_queues_the_update_before_publishing_the_ack() -> None:
    lp, events = make()
    lp.snapshot(3)
    assert [type(e) for e in events] == [Update, SyncAck]
    update, ack = events
    assert isinstance(update, Update) and update.avg.realized and update.avg.version == 1
    assert isinstance(ack, SyncAck) and ack.step_count == 0
    # The "average of one" is a copy, not an alias of the live parameters.
    for p, c in zip(lp.model.parameters(), update.avg.params):
        assert torch.equal(p, c) and p.data_ptr() != c.data_ptr()


def test_a_round_with_zero_mass_is_not_realized_and_changes_nothing() -> None:
    lp, events = make()
    lp.snapshot(0)
    update = events[0]
    assert isinstance(update, Update) and not update.avg.realized
    zeros = AveragedParams(
        params=tuple(torch.zeros_like(p) for p in lp.model.parameters()),
        buffers=(),
        version=2,
        realized=False,
    )
    lp.load_averaged(zeros)
    assert params_norm(lp.model) > 0


def test_load_averaged_with_the_wrong_tensor_count_raises() -> None:
    lp, _ = make()
    with pytest.raises(ValueError, match="params"):
        lp.load_averaged(AveragedParams(params=(), buffers=(), version=1))


def test_a_world_of_one_cannot_join_a_bigger_session() -> None:
    lp, _ = make()
    lp.new_session(b"u" * 16, 0, 1)
    with pytest.raises(ValueError, match="world of one"):
        lp.new_session(b"u" * 16, 1, 2)
