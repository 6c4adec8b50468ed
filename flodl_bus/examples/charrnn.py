"""A character-level GRU on a short story shipped with the package (no download).

Each sample is ``CONTEXT`` characters of ``data/lighthouse.txt`` and the label is the
character that follows; the metric is next-character accuracy on the last tenth of the
text, which the model never trains on. It trains in well under a minute on a CPU:

    flodl-bus up --job flodl_bus.examples.charrnn:job

How a job is written, in one place (every builder runs inside the rank process):

* ``train_data``/``eval_data`` return an ``ArrayDataset`` of two tensors; a rank gathers
  its batches from it by index, so any tensor-shaped data fits.
* ``build_model`` seeds torch itself, so every rank starts from the same weights.
* ``loss_fn`` (default: cross-entropy on ``model(x)``) and ``eval_fn`` (default: accuracy)
  take the model and a batch / the eval dataset; they need no changes for a classifier,
  and a next-character model is one.
* ``lr_at`` is a pure function of the global step, so every rank computes the same LR.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import torch
from torch import nn

from flodl_bus.job import ArrayDataset, Job

CONTEXT = 16
_EVAL_FRACTION = 0.1
_TEXT = "lighthouse.txt"


@lru_cache(maxsize=1)
def text() -> str:
    # Newlines inside a paragraph are line wrapping, not content: fold them to spaces so
    # the model spends its capacity on words.
    raw = resources.files("flodl_bus.examples").joinpath("data", _TEXT).read_text("utf-8")
    paragraphs = [" ".join(p.split()) for p in raw.split("\n\n")]
    return "\n".join(p for p in paragraphs if p)


@lru_cache(maxsize=1)
def vocab() -> str:
    return "".join(sorted(set(text())))


def encode(s: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(vocab())}
    return torch.tensor([index[c] for c in s], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    chars = vocab()
    return "".join(chars[int(i)] for i in ids)


def _windows(codes: torch.Tensor) -> ArrayDataset:
    n = len(codes) - CONTEXT
    starts = torch.arange(n).unsqueeze(1) + torch.arange(CONTEXT).unsqueeze(0)
    return ArrayDataset(codes[starts], codes[CONTEXT:].clone())


@lru_cache(maxsize=1)
def _split() -> tuple[ArrayDataset, ArrayDataset]:
    codes = encode(text())
    cut = int(len(codes) * (1 - _EVAL_FRACTION))
    # The eval windows start after the cut, so no eval label is ever a training input.
    return _windows(codes[:cut]), _windows(codes[cut:])


def train_data() -> ArrayDataset:
    return _split()[0]


def eval_data() -> ArrayDataset:
    return _split()[1]


class CharGRU(nn.Module):
    """Embedding -> one GRU layer -> logits of the next character."""

    def __init__(self, vocab_size: int, embed: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(self.embed(x))
        out: torch.Tensor = self.head(h[-1])
        return out


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    return CharGRU(len(vocab()))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def generate(model: nn.Module, prompt: str, length: int = 80) -> str:
    """Greedy continuation of ``prompt`` (characters outside the vocabulary are dropped)."""
    known = set(vocab())
    codes = encode("".join(c for c in prompt if c in known) or " ")
    with torch.no_grad():
        for _ in range(length):
            logits = model(codes[-CONTEXT:].unsqueeze(0))
            codes = torch.cat([codes, logits.argmax(dim=1)])
    return decode(codes)


job = Job(
    name="charrnn-lighthouse",
    build_model=build_model,
    build_optimizer=build_optimizer,
    train_data=train_data,
    eval_data=eval_data,
    batch_size=64,
    num_epochs=6,
    lr_at=lambda _step: 1e-2,
    max_grad_norm=1.0,
    target_metric=0.45,
    # Adam's step does not grow with the batch, so flodl's linear scaling (2e-2 on two
    # ranks) only doubles it: 0.50-0.56 final accuracy on two CPU ranks against 0.53-0.60
    # (medians 0.58) at the LR as given; DDP's 0.58 (BENCHMARKS.md, 2026-12-07).
    lr_scale_ratio=0.0,
)
