"""The measured profile (components/perf/profile.py): interpolation exact at grid points and bounded between them,
extrapolation by the fitted model's increments, the JSON round trip and its errors, and the least-squares fit."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from components.perf.errors import ProfileFormatError
from components.perf.model import StepTimeModel
from components.perf.profile import PerfModel, Point, Profile, nnls

pytestmark = pytest.mark.unit

TRUE = StepTimeModel(
    prefill_base_ms=10.0,
    prefill_ms_per_token=0.02,
    prefill_ms_per_token_sq=1e-6,
    decode_base_ms=4.0,
    decode_ms_per_seq=0.05,
    decode_ms_per_kv_token=2e-5,
    max_num_batched_tokens=4096,
)
PROMPTS = [16, 256, 1024, 4096]
BATCHES = [1, 8, 32]
CONTEXTS = [128.0, 1024.0, 4096.0]


def measured(model=TRUE, noise: float = 0.0, seed: int = 0, repeats: int = 3) -> Profile:
    """A profile of ``model`` as a measurer would record it: ``repeats`` samples per point, each off by a uniform
    relative error of at most ``noise``."""
    rng = random.Random(seed)

    def samples(v: float) -> list[float]:
        return [v * (1 + rng.uniform(-noise, noise)) for _ in range(repeats)]

    return Profile.build(
        prompt_tokens=PROMPTS,
        prefill_samples_ms=[samples(model.prefill_ms(n)) for n in PROMPTS],
        batch_sizes=BATCHES,
        context_tokens=CONTEXTS,
        decode_samples_ms=[[samples(model.decode_ms(b, b * c)) for c in CONTEXTS] for b in BATCHES],
        max_num_batched_tokens=model.max_num_batched_tokens,
        meta={"engine": "synthetic"},
    )


def bumpy() -> Profile:
    """A profile whose medians the model does not describe (a step at 1024 prompt tokens, a dip at 8 x 1024), so
    interpolation is tested on its own rather than by agreeing with the fit."""
    pre = [[5.0], [9.0], [30.0], [60.0]]
    dec = [[[3.0], [4.0], [6.0]], [[5.0], [4.5], [9.0]], [[8.0], [12.0], [20.0]]]
    return Profile.build(
        prompt_tokens=PROMPTS,
        prefill_samples_ms=pre,
        batch_sizes=BATCHES,
        context_tokens=CONTEXTS,
        decode_samples_ms=dec,
        max_num_batched_tokens=4096,
    )


def test_both_the_model_and_a_profile_are_perf_models():
    assert isinstance(TRUE, PerfModel)
    assert isinstance(measured(), PerfModel)


def test_a_point_keeps_median_and_spread():
    p = Point.of([12.0, 10.0, 11.0, 30.0])
    assert (p.median_ms, p.min_ms, p.max_ms, p.repeats) == (11.5, 10.0, 30.0, 4)
    assert p.spread == pytest.approx(20.0 / 11.5)


def test_interpolation_is_exact_at_grid_points_and_bounded_between_neighbours():
    p = bumpy()
    for n, pt in zip(PROMPTS, p.prefill, strict=True):
        assert p.prefill_ms(n) == pt.median_ms
    for (lo, hi), (a, b) in zip(itertools.pairwise(PROMPTS), itertools.pairwise(p.prefill), strict=True):
        for n in range(lo, hi + 1, max(1, (hi - lo) // 37)):
            assert min(a.median_ms, b.median_ms) <= p.prefill_ms(n) <= max(a.median_ms, b.median_ms)
    # halfway between 256 (9 ms) and 1024 (30 ms): 19.5 ms
    assert p.prefill_ms(640) == pytest.approx(19.5)
    for i, b in enumerate(BATCHES):
        for j, c in enumerate(CONTEXTS):
            assert p.decode_ms(b, int(b * c)) == pytest.approx(p.decode[i][j].median_ms, rel=1e-12)
    # bilinear: the middle of the cell 1..8 x 128..1024 is the mean of its corners, (3 + 4 + 5 + 4.5) / 4 = 4.125
    b, c = 4.5, 576.0
    assert p.decode_ms(b, b * c) == pytest.approx(4.125)
    corners = [p.decode[i][j].median_ms for i in (0, 1) for j in (0, 1)]
    for b, c in itertools.product(range(1, 9), (128.0, 300.0, 700.0, 1024.0)):
        assert min(corners) <= p.decode_ms(b, b * c) <= max(corners)
    assert p.prefill_ms(0) == 0.0 and p.decode_ms(0, 100) == 0.0


def test_beyond_the_grid_the_edge_value_moves_by_the_fitted_model():
    p = bumpy()
    # f(x) = f(edge) + fit(x) - fit(edge): past 4096 prompt tokens and below 16
    assert p.prefill_ms(10000) == pytest.approx(60.0 + p.fit.prefill_ms(10000) - p.fit.prefill_ms(4096))
    assert p.prefill_ms(4) == pytest.approx(max(0.0, 5.0 + p.fit.prefill_ms(4) - p.fit.prefill_ms(16)))
    # batch 64 x context 8192: clamped to 32 x 4096 (20 ms) plus the fit's increment
    assert p.decode_ms(64, 64 * 8192) == pytest.approx(
        20.0 + p.fit.decode_ms(64, 64 * 8192) - p.fit.decode_ms(32, 32 * 4096.0)
    )
    # A profile of exactly the analytic model extrapolates to the model itself.
    q = measured()
    assert q.prefill_ms(20000) == pytest.approx(TRUE.prefill_ms(20000), rel=1e-9)
    assert q.decode_ms(256, 256 * 16384) == pytest.approx(TRUE.decode_ms(256, 256 * 16384), rel=1e-9)


def test_the_fit_recovers_known_coefficients():
    exact = measured()
    for name in ("prefill_base_ms", "prefill_ms_per_token", "prefill_ms_per_token_sq"):
        assert getattr(exact.fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    for name in ("decode_base_ms", "decode_ms_per_seq", "decode_ms_per_kv_token"):
        assert getattr(exact.fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    assert exact.fit_error["prefill_rel_max"] < 1e-12 and exact.fit_error["decode_rel_max"] < 1e-12
    # With 2% noise on every sample the medians are within 2% of the truth, so the fit's predictions on the grid
    # are too, within ~2% plus what 3 coefficients fitted to 4 (9) points can add: 5% is checked.
    noisy = measured(noise=0.02, seed=3)
    for n in PROMPTS:
        assert noisy.fit.prefill_ms(n) == pytest.approx(TRUE.prefill_ms(n), rel=0.05)
    for b, c in itertools.product(BATCHES, CONTEXTS):
        assert noisy.fit.decode_ms(b, b * c) == pytest.approx(TRUE.decode_ms(b, b * c), rel=0.05)
    assert 0 < noisy.fit_error["prefill_rel_max"] < 0.05


def test_nnls_keeps_coefficients_non_negative():
    # y = 2 - 0.5 x would need a negative slope; the best non-negative fit is the constant mean, 1.25.
    rows = [[1.0, float(x)] for x in range(4)]
    ys = [2.0 - 0.5 * x for x in range(4)]
    assert nnls(rows, ys, [1.0] * 4) == pytest.approx([1.25, 0.0])


def test_json_round_trip_keeps_everything_and_the_id():
    p = measured(noise=0.05, seed=1)
    q = Profile.from_json(p.to_json())
    assert q == p
    assert q.profile_id == p.profile_id and p.profile_id.startswith("sha256:")
    assert StepTimeModel.from_mapping(q.step_time()) == q.fit


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: d.update(format="something"), "format"),
        (lambda d: d["prefill"].update(prompt_tokens=[16, 8, 1024, 4096]), "prefill.prompt_tokens"),
        (lambda d: d["prefill"]["median_ms"].pop(), "prefill.median_ms"),
        (lambda d: d["decode"]["median_ms"][1].__setitem__(2, "fast"), "decode[1].median_ms[2]"),
        (lambda d: d["decode"]["min_ms"][0].__setitem__(0, 1e9), "decode[0][0]"),
        (lambda d: d.update(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (lambda d: d["fit"].update(decode_base_ms=99.0), "fit.decode_base_ms"),
    ],
)
def test_malformed_json_names_the_bad_field(edit, where):
    d = json.loads(measured().to_json())
    edit(d)
    with pytest.raises(ProfileFormatError) as e:
        Profile.from_json(json.dumps(d), source="p.json")
    assert e.value.where == where
    assert str(e.value).startswith(f"p.json: bad profile field {where!r}")


def test_not_json_at_all_is_a_format_error():
    with pytest.raises(ProfileFormatError, match="not JSON"):
        Profile.from_json("{oops")
