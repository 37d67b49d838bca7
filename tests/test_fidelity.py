"""Fidelity of a fast path's images to the exact path's (bench/fidelity.py): the per-image metrics against analytic
values and an independent SSIM, the bootstrap's coverage and width, and the paired test against the noise floor."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from bench.fidelity import (
    MARGINS,
    METRICS,
    bootstrap_mean,
    image_fidelity,
    loss,
    paired_excess,
    ssim,
    summarise_fidelity,
)

SIZE = 256


@dataclasses.dataclass(frozen=True)
class Obj:
    mask: np.ndarray
    centroid: tuple[float, float]
    rgb: tuple[float, float, float]
    frequency: float


@dataclasses.dataclass(frozen=True)
class Reading:
    objects: tuple[Obj, ...]


def square(x0: int, y0: int, side: int, rgb=(200.0, 40.0, 90.0), frequency=0.1) -> Obj:
    """A square object whose centroid is its mask's (x, y), as a detector reads it."""
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[y0:y0 + side, x0:x0 + side] = True
    ys, xs = np.nonzero(mask)
    return Obj(mask, (float(xs.mean()), float(ys.mean())), tuple(map(float, rgb)), float(frequency))


def noise_image(rng, size: int = SIZE) -> np.ndarray:
    return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def smooth_image(rng) -> np.ndarray:
    """A picture-like image: structure at several scales (SSIM's response to noise is then not trivially flat)."""
    from scipy.ndimage import gaussian_filter

    field = gaussian_filter(rng.normal(size=(SIZE, SIZE, 3)), sigma=(4, 4, 0))
    field = (field - field.min()) / (field.max() - field.min())
    return (30 + 190 * field).astype(np.uint8)


def reference_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM written out directly, by another route than the module's: an explicit 11x11 Gaussian window over every
    window lying wholly inside the image (no filtering, no boundary mode), centred (co)variances."""
    weights = np.array([0.299, 0.587, 0.114])
    x, y = a.astype(np.float64) @ weights, b.astype(np.float64) @ weights
    offsets = np.arange(-5, 6, dtype=np.float64)
    g = np.exp(-offsets ** 2 / (2 * 1.5 ** 2))
    window = np.outer(g, g) / np.outer(g, g).sum()
    wx, wy = sliding_window_view(x, (11, 11)), sliding_window_view(y, (11, 11))
    mu_x = np.einsum("ijkl,kl->ij", wx, window)
    mu_y = np.einsum("ijkl,kl->ij", wy, window)
    dx, dy = wx - mu_x[..., None, None], wy - mu_y[..., None, None]
    var_x = np.einsum("ijkl,kl->ij", dx * dx, window)
    var_y = np.einsum("ijkl,kl->ij", dy * dy, window)
    cov = np.einsum("ijkl,kl->ij", dx * dy, window)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    index = (2 * mu_x * mu_y + c1) * (2 * cov + c2) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return float(index.mean())


# --- per image ---------------------------------------------------------------------------------------------------


def test_identical_images_and_readings_are_perfect():
    rng = np.random.default_rng(11)
    image = noise_image(rng)
    objects = tuple(square(int(rng.integers(0, 100)) + 120 * i, int(rng.integers(0, 150)), int(rng.integers(20, 60)),
                           rgb=rng.uniform(0, 255, 3), frequency=rng.uniform(0, 0.5)) for i in range(2))
    result = image_fidelity(image, image.copy(), Reading(objects), Reading(objects))
    assert tuple(result) == METRICS
    assert result["mask_iou"] == 1.0
    assert result["centroid_shift"] == 0.0
    assert result["colour_distance"] == 0.0
    assert result["frequency_error"] == 0.0
    assert result["ssim"] == 1.0  # exactly, not approximately


def test_shifted_square_gives_analytic_iou_and_shift():
    rng = np.random.default_rng(12)
    side, dx, dy = 40, 3, 4
    ref, run = square(60, 80, side), square(60 + dx, 80 + dy, side)
    inter = (side - dx) * (side - dy)
    image = noise_image(rng)
    result = image_fidelity(image, image, Reading((run,)), Reading((ref,)))
    assert result["mask_iou"] == pytest.approx(inter / (2 * side * side - inter), abs=1e-12)
    assert result["centroid_shift"] == pytest.approx(math.hypot(dx, dy), abs=1e-12)
    assert result["colour_distance"] == 0.0
    assert result["frequency_error"] == 0.0


def test_colour_and_frequency_differences_of_known_size():
    rng = np.random.default_rng(13)
    base = rng.uniform(20, 200, 3)
    ref = square(30, 30, 50, rgb=base, frequency=0.125)
    run = square(30, 30, 50, rgb=base + np.array([3.0, -4.0, 12.0]), frequency=0.1)
    image = noise_image(rng)
    result = image_fidelity(image, image, Reading((run,)), Reading((ref,)))
    assert result["colour_distance"] == pytest.approx(13.0, abs=1e-9)
    assert result["frequency_error"] == pytest.approx(0.025, abs=1e-12)
    assert result["mask_iou"] == 1.0 and result["centroid_shift"] == 0.0


def test_each_reference_object_takes_the_run_object_overlapping_it_best():
    rng = np.random.default_rng(14)
    image = noise_image(rng)
    ref_a, ref_b = square(20, 20, 40, rgb=(10, 10, 10)), square(150, 150, 40, rgb=(50, 50, 50))
    # a run object that just touches ref_a, listed first, and one that overlaps it well; ref_b missed entirely
    touching, good = square(58, 58, 30, rgb=(250, 250, 250)), square(22, 20, 40, rgb=(10, 10, 16))
    result = image_fidelity(image, image, Reading((touching, good)), Reading((ref_a, ref_b)))
    assert result["mask_iou"] == pytest.approx((38 * 40 / (2 * 1600 - 38 * 40) + 0.0) / 2, abs=1e-12)
    assert result["centroid_shift"] == pytest.approx(2.0, abs=1e-12)  # ref_a with `good` alone: ref_b unmatched
    assert result["colour_distance"] == pytest.approx(6.0, abs=1e-12)


def test_no_match_and_empty_readings():
    rng = np.random.default_rng(15)
    image = noise_image(rng)
    ref, elsewhere = square(10, 10, 30), square(150, 150, 30)
    missed = image_fidelity(image, image, Reading((elsewhere,)), Reading((ref,)))
    assert missed["mask_iou"] == 0.0
    assert all(math.isnan(missed[m]) for m in ("centroid_shift", "colour_distance", "frequency_error"))
    lost = image_fidelity(image, image, Reading(()), Reading((ref,)))
    assert lost["mask_iou"] == 0.0 and math.isnan(lost["centroid_shift"])
    both_empty = image_fidelity(image, image, Reading(()), Reading(()))
    assert both_empty["mask_iou"] == 1.0 and math.isnan(both_empty["colour_distance"])
    assert both_empty["ssim"] == 1.0
    spurious = image_fidelity(image, image, Reading((elsewhere,)), Reading(()))
    assert spurious["mask_iou"] == 0.0 and math.isnan(spurious["frequency_error"])


def test_mismatched_shapes_are_refused():
    rng = np.random.default_rng(16)
    with pytest.raises(ValueError):
        image_fidelity(noise_image(rng), noise_image(rng, 128), Reading(()), Reading(()))


# --- SSIM --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("amplitude", [None, 8.0, 40.0])
def test_ssim_matches_a_direct_windowed_reference(amplitude):
    rng = np.random.default_rng(17)
    a = noise_image(rng)
    if amplitude is None:  # two unrelated noise images
        b = noise_image(rng)
    else:
        b = np.clip(a + rng.normal(0, amplitude, a.shape), 0, 255).astype(np.uint8)
    expected = reference_ssim(b, a)
    assert ssim(b, a) == pytest.approx(expected, abs=1e-6)
    assert image_fidelity(b, a, Reading(()), Reading(()))["ssim"] == pytest.approx(expected, abs=1e-6)
    assert ssim(a, b) == pytest.approx(ssim(b, a), abs=1e-12)  # symmetric


def test_ssim_decreases_with_noise_amplitude():
    rng = np.random.default_rng(18)
    image = smooth_image(rng)
    noise = rng.normal(size=image.shape)
    amplitudes = [0.5, 2, 5, 10, 20, 40, 80]
    values = [ssim(np.clip(image + a * noise, 0, 255).astype(np.uint8), image) for a in amplitudes]
    assert values[0] < 1.0
    assert all(later < earlier for earlier, later in zip(values, values[1:])), values
    assert values[-1] < 0.5


# --- statistics --------------------------------------------------------------------------------------------------


def test_loss_directions():
    assert loss("mask_iou", 0.75) == 0.25 and loss("ssim", 1.0) == 0.0
    assert loss("centroid_shift", 1.5) == 1.5 and loss("colour_distance", 3.0) == 3.0
    assert loss("frequency_error", 0.01) == 0.01
    assert math.isnan(loss("ssim", float("nan"))) and math.isnan(loss("mask_iou", None))
    with pytest.raises(ValueError):
        loss("psnr", 30.0)


def test_bootstrap_contains_the_true_mean_and_narrows_as_one_over_sqrt_n():
    rng = np.random.default_rng(19)
    mu, sd = 3.0, 2.0
    widths = {}
    for n in (400, 6400):
        result = bootstrap_mean(rng.normal(mu, sd, n))
        assert result["n"] == n
        assert result["low"] < mu < result["high"]
        assert result["low"] < result["mean"] < result["high"]
        widths[n] = result["high"] - result["low"]
        # the normal interval's width, 2 * 1.96 * sd / sqrt(n)
        assert widths[n] == pytest.approx(2 * 1.96 * sd / math.sqrt(n), rel=0.15)
    assert widths[400] / widths[6400] == pytest.approx(4.0, rel=0.15)


def test_bootstrap_is_deterministic_and_drops_nans():
    rng = np.random.default_rng(20)
    values = rng.normal(1.0, 0.5, 50)
    assert bootstrap_mean(values, seed=3) == bootstrap_mean(values.copy(), seed=3)
    assert bootstrap_mean(values, seed=3) != bootstrap_mean(values, seed=4)
    with_nans = np.concatenate([values, [np.nan] * 7])
    rng.shuffle(with_nans)
    result = bootstrap_mean(list(with_nans) + [None])
    assert result["n"] == 50
    assert result["mean"] == pytest.approx(values.mean(), abs=1e-12)
    assert bootstrap_mean([np.nan, None, np.nan]) == {"mean": None, "low": None, "high": None, "n": 0}
    assert bootstrap_mean([]) == {"mean": None, "low": None, "high": None, "n": 0}
    single = bootstrap_mean([2.5])
    assert single["mean"] == single["low"] == single["high"] == 2.5 and single["n"] == 1


def test_paired_excess_flags_a_clearly_worse_run_only():
    rng = np.random.default_rng(21)
    n, margin = 200, 0.01
    floor = rng.uniform(0.02, 0.2, n)  # cases differ in difficulty far more than the paths do
    worse = paired_excess(floor + 0.05 + rng.normal(0, 0.01, n), floor, margin)
    assert worse["flagged"] and worse["low"] > margin and worse["n"] == n and worse["margin"] == margin
    equal = paired_excess(floor + rng.normal(0, 0.01, n), floor, margin)
    assert not equal["flagged"] and equal["low"] < 0 < equal["high"]
    slightly = paired_excess(floor + margin / 2 + rng.normal(0, 0.01, n), floor, margin)
    assert not slightly["flagged"] and slightly["low"] > 0  # worse than the floor, but by less than the margin


def test_paired_excess_drops_cases_with_either_side_nan():
    rng = np.random.default_rng(22)
    run, floor = rng.uniform(0, 1, 10), rng.uniform(0, 1, 10)
    run[2], floor[5], floor[7] = np.nan, np.nan, np.nan
    result = paired_excess(run, floor, 0.1)
    keep = ~(np.isnan(run) | np.isnan(floor))
    assert result["n"] == 7
    assert result["mean"] == pytest.approx((run[keep] - floor[keep]).mean(), abs=1e-12)
    none = paired_excess([np.nan, 1.0], [0.0, np.nan], 0.1)
    assert none["n"] == 0 and none["mean"] is None and none["flagged"] is False
    with pytest.raises(ValueError):
        paired_excess([1.0, 2.0], [1.0], 0.1)


def test_summarise_fidelity_flags_the_metric_that_is_worse():
    rng = np.random.default_rng(23)
    n = 60

    def cases(colour_offset: float) -> list[dict[str, float]]:
        return [{"mask_iou": rng.uniform(0.9, 1.0), "centroid_shift": rng.uniform(0, 0.5),
                 "colour_distance": rng.uniform(0, 2) + colour_offset, "frequency_error": rng.uniform(0, 0.002),
                 "ssim": rng.uniform(0.95, 1.0)} for _ in range(n)]

    floor = cases(0.0)
    run = [dict(case) for case in floor]
    for case in run:  # the same cases, with colour worse by far more than its margin and the rest as the floor's
        case["colour_distance"] += 3 * MARGINS["colour_distance"]
    run[0]["centroid_shift"] = float("nan")
    summary = summarise_fidelity(run, floor)
    assert list(summary)[:len(METRICS)] == list(METRICS)
    assert summary["flagged"] is True and summary["flagged_by"] == ["colour_distance"]
    assert summary["centroid_shift"]["value"]["n"] == n - 1
    assert summary["centroid_shift"]["excess"]["n"] == n - 1
    assert summary["colour_distance"]["excess"]["margin"] == MARGINS["colour_distance"]

    clean = summarise_fidelity(cases(0.0), floor)
    assert clean["flagged"] is False and clean["flagged_by"] == []

    alone = summarise_fidelity(run, None)
    assert alone["flagged"] is None and alone["flagged_by"] == []
    assert all(alone[m]["excess"] is None for m in METRICS)
    assert alone["mask_iou"]["value"]["mean"] == pytest.approx(np.mean([c["mask_iou"] for c in run]), abs=1e-12)
    with pytest.raises(ValueError):
        summarise_fidelity(run, floor[:-1])


def test_summarise_fidelity_of_real_images_against_a_floor():
    """End to end: the floor is a second exact run (identical here), the run a noisier copy with shifted objects."""
    rng = np.random.default_rng(24)
    per_case, floor_per_case = [], []
    for _ in range(12):
        reference = smooth_image(rng)
        ref_reading = Reading((square(int(rng.integers(20, 100)), int(rng.integers(20, 100)), 50),))
        obj = ref_reading.objects[0]
        moved = Obj(np.roll(obj.mask, 3, axis=1), (obj.centroid[0] + 3, obj.centroid[1]), obj.rgb, obj.frequency)
        noisy = np.clip(reference + rng.normal(0, 20, reference.shape), 0, 255).astype(np.uint8)
        per_case.append(image_fidelity(noisy, reference, Reading((moved,)), ref_reading))
        floor_per_case.append(image_fidelity(reference.copy(), reference, ref_reading, ref_reading))
    summary = summarise_fidelity(per_case, floor_per_case, rounds=500)
    assert set(summary["flagged_by"]) == {"mask_iou", "centroid_shift", "ssim"}
    assert summary["centroid_shift"]["value"]["mean"] == pytest.approx(3.0, abs=1e-9)
