"""``TorchModelPort`` saves and scores the last realized consensus (flodl's
``last_consensus``), not the live model the rank trained on since."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from flodl_bus.job import ArrayDataset
from flodl_bus.protocol.messages import SaveReason
from flodl_bus.worker.model_port import ConsensusSource, TorchModelPort


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.bn = nn.BatchNorm1d(1)


class Kept:
    """What the param plane holds after a round: params and averaged buffers."""

    def __init__(self, model: nn.Module, value: float) -> None:
        floats = [b for b in model.buffers() if b.dtype == torch.float32]
        self.params = [torch.full_like(p, value) for p in model.parameters()]
        self.buffers = [torch.full_like(b, value) for b in floats]

    def consensus(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None:
        return self.params, self.buffers


def weight_sum(model: nn.Module, _data: ArrayDataset) -> float:
    return float(sum(p.detach().sum() for p in model.parameters()))


def port(model: nn.Module, source: ConsensusSource | None, tmp_path: Path) -> TorchModelPort:
    data = ArrayDataset(torch.zeros(4, 2), torch.zeros(4))
    return TorchModelPort(
        rank=0,
        model=model,
        eval_fn=weight_sum,
        eval_data=data,
        save_path=str(tmp_path / "run"),
        consensus=source,
    )


def test_the_consensus_save_writes_the_consensus_not_the_live_model(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(9.0)
    kept = Kept(model, 2.0)
    assert isinstance(kept, ConsensusSource)
    port(model, kept, tmp_path).save_consensus()
    saved = torch.load(tmp_path / "run.model.pt")
    assert torch.equal(saved["lin.weight"], torch.full((1, 2), 2.0))
    assert torch.equal(saved["bn.running_mean"], torch.full((1,), 2.0))
    assert saved["bn.num_batches_tracked"].dtype == torch.int64  # counters stay local
    assert torch.equal(model.lin.weight, torch.full((1, 2), 9.0))  # live model untouched
    fresh = Net()
    fresh.load_state_dict(torch.load(tmp_path / "run.model.pt"))  # the one-line load


def test_a_consensus_eval_scores_the_consensus_and_restores_the_live_model_bit_for_bit(
    tmp_path: Path,
) -> None:
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))  # values whose every bit a sloppy restore loses
    live = {k: v.clone() for k, v in model.state_dict().items()}
    p = port(model, Kept(model, 1.0), tmp_path)
    n = sum(t.numel() for t in model.parameters())
    assert p.evaluate_consensus() == float(n)  # every consensus weight is 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in live.items())
    # The same port, asked for the live model, scores the live model.
    assert p.evaluate() == weight_sum(model, ArrayDataset(torch.zeros(1, 2), torch.zeros(1)))
    assert p.evaluate() != float(n)


def test_a_live_eval_or_no_consensus_yet_scores_the_live_model(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        for q in model.parameters():
            q.fill_(9.0)
    n = sum(t.numel() for t in model.parameters())
    assert port(model, Kept(model, 1.0), tmp_path).evaluate() == 9.0 * n
    assert port(model, None, tmp_path).evaluate() == 9.0 * n
    assert port(model, None, tmp_path).evaluate_consensus() == 9.0 * n
    port(model, None, tmp_path).save_consensus()
    assert torch.equal(torch.load(tmp_path / "run.model.pt")["lin.weight"], model.lin.weight)


def test_checkpoint_fn_sees_the_consensus_and_the_live_model_comes_back(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        for q in model.parameters():
            q.fill_(9.0)
    seen: list[tuple[int, torch.Tensor]] = []
    p = port(model, Kept(model, 2.0), tmp_path)
    p.checkpoint_fn = lambda version, m: seen.append((version, m.lin.weight.detach().clone()))
    p.checkpoint(4)
    assert seen[0][0] == 4 and torch.equal(seen[0][1], torch.full((1, 2), 2.0))
    assert torch.equal(model.lin.weight, torch.full((1, 2), 9.0))


def test_a_bundle_model_is_the_consensus_written_by_the_role_rank_only(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        for q in model.parameters():
            q.fill_(9.0)
    role = 1
    for rank in (0, 1):
        p = TorchModelPort(
            rank=rank,
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            save_path=str(tmp_path / "run"),
            consensus=Kept(model, 2.0),
            writer_role=lambda: role,
        )
        p.save_bundle(SaveReason.SINGLE_SURVIVOR)
        # Rank 0 is not the role: it writes its own state but no model.
        assert (tmp_path / "run.model.pt").exists() == (rank == 1)
        assert (tmp_path / f"run.rank{rank}.state.pt").exists()
    assert '"writer_rank": 1' in (tmp_path / "run.bundle.json").read_text()
    saved = torch.load(tmp_path / "run.model.pt")
    assert torch.equal(saved["lin.weight"], torch.full((1, 2), 2.0))
