"""Jobs: resolving ``--job MODULE:NAME``, the array dataset, and the bundled digits job."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from flodl_bus.examples import digits
from flodl_bus.job import ArrayDataset, Job, load_job


@pytest.fixture
def job_module() -> Iterator[str]:
    """A real importable module holding a job, a factory, and things that are not jobs."""
    mod = types.ModuleType("flodl_test_jobs")
    mod.job = digits.job  # type: ignore[attr-defined]
    mod.make_job = lambda: digits.job  # type: ignore[attr-defined]
    mod.needs_args = lambda lr: digits.job  # type: ignore[attr-defined]
    mod.number = 3  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        yield mod.__name__
    finally:
        del sys.modules[mod.__name__]


def exit_message(ref: str) -> str:
    with pytest.raises(SystemExit) as info:
        load_job(ref)
    message = str(info.value.code)
    assert "\n" not in message, "the error must be one line"
    assert message.startswith(f"--job {ref!r}: ")
    return message


def test_a_job_and_a_zero_argument_factory_both_load(job_module: str) -> None:
    assert load_job(f"{job_module}:job") is digits.job
    assert load_job(f"{job_module}:make_job") is digits.job
    assert load_job("flodl_bus.examples.digits:job").name == "digits-mlp"


@pytest.mark.parametrize("ref", ["nocolon", ":job", "flodl_bus.examples.digits:"])
def test_a_ref_without_module_and_name_says_the_expected_form(ref: str) -> None:
    assert "expected MODULE:NAME, e.g. flodl_bus.examples.digits:job" in exit_message(ref)


@pytest.mark.parametrize("ref", ["no_such_module_4711:job", ".relative:job"])
def test_an_unimportable_module_says_how_to_make_it_importable(ref: str) -> None:
    message = exit_message(ref)
    assert "cannot import" in message and "PYTHONPATH" in message


def test_a_missing_attribute_names_the_module_and_what_to_name(job_module: str) -> None:
    message = exit_message(f"{job_module}:nope")
    assert f"{job_module} has no attribute 'nope'" in message
    assert "name a Job" in message


@pytest.mark.parametrize(("attr", "kind"), [("number", "int"), ("needs_args", None)])
def test_something_that_is_not_a_job_says_to_point_at_one(
    job_module: str, attr: str, kind: str | None
) -> None:
    message = exit_message(f"{job_module}:{attr}")
    if kind:
        assert f"is a {kind}, not a flodl_bus Job" in message
    else:
        assert "takes arguments" in message
    assert "point --job at a Job or a zero-argument function returning one" in message


def test_a_factory_returning_something_else_is_refused() -> None:
    message = exit_message("flodl_bus.examples.digits:build_model")
    assert "is a Sequential, not a flodl_bus Job" in message


def test_batch_gathers_picks_and_wraps_past_the_end() -> None:
    ds = ArrayDataset(torch.arange(10.0).reshape(10, 1), torch.arange(10) * 10)
    x, y = ds.batch([3, 13, 25, 9])
    assert x.flatten().tolist() == [3.0, 3.0, 5.0, 9.0]
    assert y.tolist() == [30, 30, 50, 90]


def test_mismatched_inputs_and_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="10 inputs but 9 labels"):
        ArrayDataset(torch.zeros(10, 2), torch.zeros(9))


def test_signature_follows_content() -> None:
    a = ArrayDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    b = ArrayDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    c = ArrayDataset(torch.zeros(4, 2), torch.tensor([0, 0, 0, 1]))
    assert a.signature() == b.signature() != c.signature()
    assert len(a.signature()) == 16


def test_digits_job_data_sizes_and_ranges() -> None:
    job = load_job("flodl_bus.examples.digits:job")
    assert isinstance(job, Job)
    train, test = job.train_data(), job.eval_data() if job.eval_data else None
    assert test is not None
    # scikit-learn's bundled digits: 1797 8x8 images, 20% held out
    assert len(train) + len(test) == 1797
    assert len(test) == int(1797 * 0.2) == 359
    assert train.x.shape == (1438, 64) and train.x.dtype == torch.float32
    assert train.y.dtype == torch.long
    assert float(train.x.min()) >= 0.0 and float(train.x.max()) <= 1.0
    assert set(train.y.tolist()) == set(range(10))
    # every rank must build the same data and the same starting weights
    assert train.signature() == job.train_data().signature()
    m1, m2 = job.build_model(), job.build_model()
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert m1(train.x[:5]).shape == (5, 10)


def test_planned_steps_count_full_batches_of_the_whole_run_whatever_the_world() -> None:
    job = Job("j", digits.build_model, digits.build_optimizer, digits.train_data, batch_size=64)
    assert job.planned_steps(4, 20_000) == 4 * (20_000 // 64)
    assert job.planned_steps(0, 20_000) == 1  # a schedule never divides by zero


def test_lr_schedule_replaces_lr_at_and_is_read_against_the_planned_steps() -> None:
    seen: list[tuple[int, int]] = []

    def schedule(step: int, planned: int) -> float:
        seen.append((step, planned))
        return 1.0 - step / planned

    plain = Job("j", digits.build_model, digits.build_optimizer, digits.train_data)
    assert plain.lr(5, 10) is None  # no schedule: the optimizer's own LR is the base
    stretched = Job(
        "j", digits.build_model, digits.build_optimizer, digits.train_data, lr_schedule=schedule
    )
    assert stretched.lr(5, 10) == 0.5
    assert stretched.lr(5, 20) == 0.75
    assert seen == [(5, 10), (5, 20)]


def test_the_cifar_schedule_decays_over_the_run_it_is_given_not_a_fixed_epoch_count() -> None:
    from flodl_bus.examples import cifar_resnet

    job = cifar_resnet.job
    four, eight = (job.planned_steps(e, cifar_resnet.TRAIN) for e in (4, 8))
    peak = job.lr(0, four)
    # Halfway through an 8-epoch run the LR is where a 4-epoch run is halfway, not
    # already at the floor.
    assert job.lr(four, eight) == pytest.approx(job.lr(four // 2, four))
    assert job.lr(four, eight) == pytest.approx(peak / 2, rel=0.01)
    assert job.lr(eight, eight) == pytest.approx(0.05 * peak)


def test_the_default_eval_scores_any_map_style_dataset_as_an_array_dataset() -> None:
    """Issue 30: `train_data` took any Dataset, the default eval only an ArrayDataset."""
    from torch.utils.data import Dataset

    from flodl_bus.job import accuracy

    arrays = digits.eval_data()

    class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __len__(self) -> int:
            return len(arrays)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return arrays.x[i], arrays.y[i]

    torch.manual_seed(0)
    model = digits.build_model()
    assert accuracy(model, Rows(), chunk=100) == accuracy(model, arrays, chunk=100)


def test_the_model_signature_is_its_names_shapes_and_dtypes_told_without_using_the_rng() -> None:
    from torch import nn

    from flodl_bus.examples import digits
    from flodl_bus.job import model_signature

    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    sig = model_signature(digits.job.build_model)  # it seeds the RNG itself
    assert torch.equal(torch.rand(3), want)
    assert sig is not None and sig == model_signature(digits.job.build_model)
    wider = model_signature(lambda: nn.Sequential(nn.Linear(64, 129), nn.Linear(129, 10)))
    halves = model_signature(lambda: digits.job.build_model().half())
    assert None not in (wider, halves) and len({sig, wider, halves}) == 3

    def reads_its_weights() -> nn.Module:
        m = nn.Linear(2, 2)
        m.weight.detach().numpy()  # not on the meta device: no signature, not a failure
        return m

    assert model_signature(reads_its_weights) is None


@pytest.mark.parametrize("ratio", [-0.5, float("nan"), float("inf")])
def test_a_jobs_lr_scale_ratio_must_be_a_number_of_zero_or_more(ratio: float) -> None:
    import dataclasses

    with pytest.raises(ValueError, match="lr_scale_ratio must be a number of 0 or more"):
        dataclasses.replace(digits.job, lr_scale_ratio=ratio)


def test_a_job_asks_for_its_lr_scaling_only_where_it_states_one() -> None:
    import dataclasses

    assert digits.job.knob_defaults() == {}
    unscaled = dataclasses.replace(digits.job, lr_scale_ratio=0.0)
    assert unscaled.knob_defaults() == {"lr_scale_ratio": 0.0}
