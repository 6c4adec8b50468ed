"""What an eval scores, read per message (flodl's ``ExecuteEvalCallback.adopt_consensus``),
on a real rank's parts: ``WorkerControl``, ``TorchModelPort`` and the cpu-async
``TorchParamPort``, whose live model after a round is the EASGD blend, not the consensus."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from flodl_bus.job import ArrayDataset
from flodl_bus.params.plane import ParamConfig, TorchParamPort
from flodl_bus.protocol.messages import (
    ArmConsensusEval,
    AveragedParams,
    EvalResult,
    ExecuteEvalCallback,
    Update,
)
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.model_port import TorchModelPort

pytestmark = pytest.mark.redis


def weight_sum(model: nn.Module, _data: ArrayDataset) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class Rank:
    def __init__(self, redis_url: str) -> None:
        self.model = nn.Linear(3, 2)
        self.n = sum(p.numel() for p in self.model.parameters())
        self.port = TorchParamPort(
            list(self.model.parameters()),
            list(self.model.buffers()),
            redis_client=redis_url,
            run_id=f"adopt-{uuid.uuid4().hex[:8]}",
            rank=0,
            world_size=1,
            config=ParamConfig.for_mode("cpu-async"),
            inject=queue.Queue[Any]().put,
            publish=lambda _msg: None,
        )
        self.control = WorkerControl(
            rank=0,
            params=self.port,
            batch_size=2,
            pick_space=4,
            clock=lambda: 0.0,
            model=TorchModelPort(
                rank=0,
                model=self.model,
                eval_fn=weight_sum,
                eval_data=ArrayDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)),
                consensus=self.port,
            ),
        )

    def averaged(self, value: float, version: int) -> AveragedParams:
        params = tuple(torch.full_like(p, value) for p in self.model.parameters())
        return AveragedParams(params=params, buffers=(), version=version)

    def score(self, msg: object) -> float:
        (result,) = self.control.dispatch(msg).upstream  # type: ignore[arg-type]
        assert isinstance(result, EvalResult) and result.error is None, result
        return result.metric


@pytest.fixture
def rank(redis_url: str) -> Iterator[Rank]:
    r = Rank(redis_url)
    try:
        yield r
    finally:
        r.port.close()


def test_cpu_async_a_consensus_eval_scores_the_average_and_a_live_eval_the_blend(
    rank: Rank,
) -> None:
    with torch.no_grad():
        for p in rank.model.parameters():
            p.fill_(9.0)
    rank.port.load_averaged(rank.averaged(1.0, version=1))
    blend = {k: v.clone() for k, v in rank.model.state_dict().items()}
    assert all(torch.equal(v, torch.full_like(v, 5.0)) for v in blend.values())  # alpha 0.5

    consensus = rank.score(ExecuteEvalCallback(1, 1, target_rank=0, adopt_consensus=True))
    assert consensus == 1.0 * rank.n  # the average, not the blend
    # The live blend is back, bit for bit, and is what a live eval scores.
    assert all(torch.equal(rank.model.state_dict()[k], v) for k, v in blend.items())
    live = rank.score(ExecuteEvalCallback(2, 2, target_rank=0, adopt_consensus=False))
    assert live == 5.0 * rank.n


def test_cpu_async_an_armed_round_eval_scores_that_rounds_consensus_not_the_blend(
    rank: Rank,
) -> None:
    with torch.no_grad():
        for p in rank.model.parameters():
            p.fill_(7.0)
    rank.control.dispatch(ArmConsensusEval(schedule_id=3, epoch=3, target_rank=0))
    (result,) = rank.control.dispatch(Update(rank.averaged(3.0, version=1))).upstream
    assert isinstance(result, EvalResult) and result.error is None
    assert result.metric == 3.0 * rank.n
    assert all(torch.equal(p, torch.full_like(p, 5.0)) for p in rank.model.parameters())
