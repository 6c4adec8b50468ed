"""Digits with the script's own training loop: gradient accumulation over two batches.

A ``Job`` cannot say "step the optimizer every second batch": the bus runs its loop.
A script keeps its loop and wraps it in a ``flodl_bus.Rank``, which hands it the
coordinator's batches and takes each one's loss::

    flodl-bus up --script flodl_bus/examples/digits_own_loop.py --accumulate 2

Each rank trains the batches it is planned (every sample of an epoch exactly once over
the ranks), the bus averages the ranks' parameters as the mode says, and the run is
recorded and replays like a job's.
"""

from __future__ import annotations

import argparse

from torch import nn

import flodl_bus
from flodl_bus.examples.digits import build_model, build_optimizer, eval_data, train_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()

    # Built the same on every rank (and once in the coordinator, which reads the sizes).
    model = build_model()
    optimizer = build_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()

    with flodl_bus.Rank(
        model,
        optimizer,
        train_data(),
        batch_size=args.batch_size,
        epochs=args.epochs,
        eval_data=eval_data(),
        target_metric=0.9,
        name="digits-own-loop",
    ) as rank:
        for _epoch in rank.epochs():
            pending = 0
            for x, y in rank.batches():
                # Each batch's gradient is a share of the accumulated step's.
                loss = loss_fn(model(x), y)
                (loss / args.accumulate).backward()
                pending += 1
                if pending == args.accumulate:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    pending = 0
                rank.step(loss)
            if pending:
                # The epoch's last, short accumulation: its gradient is not carried
                # into the next epoch.
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
