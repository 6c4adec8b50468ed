"""GPU-only behaviour of the param plane (the GPU issue runs these on a real device)."""

from __future__ import annotations

import queue
import uuid
from typing import Any

import pytest
import torch

from flodl_bus.params.plane import ParamConfig, TorchParamPort
from flodl_bus.protocol.messages import SyncAck, Update

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make_port(redis_url: str, backend: str) -> tuple[TorchParamPort, list[torch.Tensor], Any]:
    params = [torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)]
    buffers = [torch.ones(2, device="cuda")]
    control: queue.Queue[Any] = queue.Queue()
    published: list[Any] = []
    port = TorchParamPort(
        params,
        buffers,
        redis_client=redis_url,
        run_id=f"cuda-{uuid.uuid4().hex[:8]}",
        rank=0,
        world_size=1,
        config=ParamConfig(backend=backend, timeout=20.0),  # type: ignore[arg-type]
        inject=control.put,
        publish=published.append,
    )
    return port, params, (control, published)


def test_cpu_path_stages_a_gpu_model_in_pinned_buffers_reused_every_round(
    redis_url: str,
) -> None:
    port, params, (control, published) = make_port(redis_url, "cpu")
    cpu = port.cpu
    assert cpu is not None
    try:
        ptrs = None
        for step in range(3):
            with torch.no_grad():
                params[0].add_(1.0)
            expected = params[0].detach().cpu().clone()
            port.snapshot(step + 1)
            with torch.no_grad():
                params[0].mul_(100.0)  # training continues on the GPU
            msg = control.get(timeout=30)
            assert isinstance(msg, Update)
            assert torch.equal(msg.avg.params[0], expected)
            port.load_averaged(msg.avg)
            # The round ends with its SyncAck, after the Update: the coordinator sends the
            # next RequestParams only once every ack is in, so the test waits as it would.
            assert cpu.wait_idle(30)
            torch.cuda.synchronize()
            assert torch.equal(params[0].cpu(), expected)
            assert cpu.snap.pinned and cpu.cons.flats[0].is_pinned()
            now = (cpu.snap.data_ptrs(), cpu.cons.data_ptrs())
            assert ptrs is None or now == ptrs
            ptrs = now
        assert isinstance(published[-1], SyncAck)
    finally:
        port.close()


def test_sync_now_on_cuda_runs_the_in_place_collective(redis_url: str) -> None:
    port, params, _ = make_port(redis_url, "nccl")
    try:
        before = params[0].detach().clone()
        res = port.sync_now(4)
        assert torch.equal(params[0], before)  # a world of one: the consensus is itself
        assert res.divergence == 0.0
        assert res.pre_norm == pytest.approx(before.norm().item())
    finally:
        port.close()
