"""``bf16_wire`` on the cpu plane across two real rank processes over gloo: the average
matches the f32 one within what bf16 rounds of each rank's change, the parameters keep
their f32 precision, and the params round moves half the bytes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.params.procs import start_ranks

pytestmark = [pytest.mark.redis, pytest.mark.slow]

#: bf16 stores 7 bits of mantissa: rounding a value errs by at most 2**-8 of it
BF16_REL = 2.0**-8

#: two rounds of both ranks; the second moves each parameter by about 1e-3 (training
#: between two averages), far below the bf16 spacing of the values (~0.008 near 1.5)
ROUNDS: list[list[dict[str, Any]]] = [
    [
        {"w": [1.2345678, -3.3333333, 0.0001234], "b": [0.5], "running": [2.0], "steps": 3},
        {"w": [1.5432109, -2.9876543, 0.0004321], "b": [0.25], "running": [4.0], "steps": 1},
    ],
    [
        {"w": [1.3117001, -3.2452, 0.0012], "b": [0.4011], "running": [3.0], "steps": 2},
        {"w": [1.3121003, -3.2439, 0.0009], "b": [0.4003], "running": [5.0], "steps": 2},
    ],
]


def _run(redis_url: str, bf16: bool) -> list[Any]:
    ranks = start_ranks(
        redis_url, "wire", 2, {"backend": "cpu", "bf16_wire": bf16, "rounds": ROUNDS}
    )
    try:
        return ranks.results()
    finally:
        ranks.kill()


def _f32_mean(rnd: list[dict[str, Any]], key: str) -> list[float]:
    # masses: steps (gamma 1); both the same in round 2, 3:1 in round 1
    total = sum(r["steps"] for r in rnd)
    return [sum(r[key][i] * r["steps"] for r in rnd) / total for i in range(len(rnd[0][key]))]


@pytest.fixture(scope="module")
def runs(redis_url: str) -> dict[bool, list[Any]]:
    return {bf16: _run(redis_url, bf16) for bf16 in (False, True)}


def test_the_bf16_wire_average_matches_the_f32_one_within_bf16_of_the_change(
    runs: dict[bool, list[Any]],
) -> None:
    f32, bf16 = runs[False], runs[True]
    second = ROUNDS[1]
    total = sum(r["steps"] for r in second)
    for rank in (0, 1):
        # the first round has no common consensus to send a change against: f32, exact
        assert bf16[rank][0]["post"] == f32[rank][0]["post"]
        base = f32[rank][0]["post"]
        for key in ("w", "b"):
            want = _f32_mean(second, key)
            got = bf16[rank][1]["post"][key]
            for i, (g, v) in enumerate(zip(got, want, strict=True)):
                # bf16 rounds each rank's weighted change and their sum, never the
                # parameter: the error is bf16's share of the changes (plus f32 noise)
                changes = [r["steps"] / total * (r[key][i] - base[key][i]) for r in second]
                rounded = sum(abs(c) for c in changes) + abs(sum(changes))
                bound = BF16_REL * rounded + 1e-6 * abs(v)
                assert abs(g - v) <= bound, (key, i, g, v, bound)
                if abs(v) > 1.0:
                    # far below what rounding the parameter itself would cost
                    assert abs(g - v) < BF16_REL * abs(v) / 64, (key, i, g, v)
        assert bf16[rank][1]["post"]["running"] == [4.0]  # buffers: their own dtype
    # every rank adopts the same consensus bits
    assert bf16[0][1]["post"] == bf16[1][1]["post"]


def test_the_bf16_wire_halves_the_bytes_of_the_params_round(
    runs: dict[bool, list[Any]],
) -> None:
    f32, bf16 = runs[False], runs[True]
    params, buffers = 4 * 4, 1 * 4  # w (3) and b (1) in f32; the running buffer
    for rank in (0, 1):
        assert f32[rank][1]["wire_bytes"] == params + buffers
        assert bf16[rank][0]["wire_bytes"] == params + buffers  # first round: f32
        assert bf16[rank][1]["wire_bytes"] == params // 2 + buffers
