"""``UserGroup`` in one process (a world of one): the default group it forms, re-forms
and closes, over a real Redis. Re-forming over several ranks after a kill is the
end-to-end test's (``tests/e2e/test_user_group.py``)."""

from __future__ import annotations

import os
import uuid

import pytest
import redis
import torch
import torch.distributed as dist

from flodl_bus.job import GroupInfo, process_group
from flodl_bus.params.groups import INITIAL_UID
from flodl_bus.params.user_group import UserGroup, UserGroupError, user_store_base

pytestmark = [pytest.mark.redis]


@pytest.fixture(autouse=True)
def _restore_master_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``form`` points MASTER_ADDR/MASTER_PORT at its store; put them back after.
    monkeypatch.setenv("MASTER_ADDR", "unset")
    monkeypatch.setenv("MASTER_PORT", "0")


def test_forms_reforms_once_per_session_and_closes(real_redis: redis.Redis) -> None:
    run = f"ug-{uuid.uuid4().hex[:8]}"
    group = UserGroup(real_redis, run, bus_rank=3, device=torch.device("cpu"))
    try:
        info = group.form(0, 1)
        assert info == GroupInfo(rank=0, world_size=1, backend="gloo", generation=0, bus_rank=3)
        assert process_group() == info
        assert dist.is_initialized() and dist.get_world_size() == 1
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        # torchrun's convention: the variables name the store the group formed on
        assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"] != "0"

        group.reform(b"next-session", 0, 1)
        info = process_group()
        assert info is not None and info.generation == 1
        dist.all_reduce(t)
        # the first generation's rendezvous keys went with it
        assert not real_redis.keys(f"{user_store_base(run)}{INITIAL_UID.hex()}/*")
        group.reform(b"next-session", 0, 1)  # the same session again: nothing to do
        assert process_group() == info
    finally:
        group.close()
    assert not dist.is_initialized() and process_group() is None
    assert not real_redis.keys(f"{user_store_base(run)}*")
    group.reform(b"after-close", 0, 1)  # a late re-session after the rank's end
    assert not dist.is_initialized()


def test_refuses_a_default_group_made_by_someone_else(real_redis: redis.Redis) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = UserGroup(real_redis, "ug-other", bus_rank=0, device=torch.device("cpu"))
        with pytest.raises(UserGroupError, match="--user-group false"):
            group.form(0, 1)
    finally:
        dist.destroy_process_group()
