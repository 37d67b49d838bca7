"""How far an image drawn by a fast path is from the image the exact path drew for the same case, and whether that is
more than two exact runs differ by (the noise floor).

Per image: the objects the detector reads (silhouette overlap, centroid, colour, pattern frequency, each reference
object against the run object that overlaps it best) and SSIM of the whole images (Wang et al. 2004). Over images:
percentile bootstrap intervals of the means, and a paired test of the run's losses against the floor's on the same
cases. Pure numpy/scipy: it runs wherever the reports are read, without torch. Readings are duck-typed (`.objects`,
each with `.mask`, `.centroid`, `.rgb`, `.frequency`), so the detector is not imported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.ndimage import gaussian_filter

METRICS = ("mask_iou", "centroid_shift", "colour_distance", "frequency_error", "ssim")
# Metrics where higher is better: their loss is 1 - value. The others are losses already (pixels, 8-bit RGB levels,
# pattern changes per pixel).
HIGHER_IS_BETTER = frozenset({"mask_iou", "ssim"})

# What difference in loss beyond the noise floor counts, per metric. Set before any measurement (not fitted to one),
# at about what a person comparing the two images would notice: a percent of a silhouette's overlap, half a pixel of
# position, 2 of 255 levels of colour, a half-percent change of a pattern's frequency or of SSIM.
MARGINS: dict[str, float] = {
    "mask_iou": 0.01,
    "centroid_shift": 0.5,
    "colour_distance": 2.0,
    "frequency_error": 0.005,
    "ssim": 0.005,
}

# SSIM as Wang et al. 2004: an 11x11 Gaussian window of sigma 1.5 (gaussian_filter's radius int(3.5 * 1.5 + 0.5) = 5,
# as scikit-image's gaussian_weights), K1 = 0.01, K2 = 0.03 over 8-bit levels.
SSIM_SIGMA = 1.5
SSIM_TRUNCATE = 3.5
SSIM_K1, SSIM_K2, SSIM_L = 0.01, 0.03, 255.0
# ITU-R BT.601 luma weights: SSIM is defined on one channel, and luminance is what the eye resolves detail in.
LUMA_WEIGHTS = (0.299, 0.587, 0.114)


def luminance(image) -> np.ndarray:
    """BT.601 luminance of an HxWx3 image, float64 in 8-bit levels (float64: SSIM's variances cancel large terms)."""
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"expected an HxWx3 image, got shape {array.shape}")
    return array.astype(np.float64) @ np.asarray(LUMA_WEIGHTS, dtype=np.float64)


def ssim(run_image, reference_image) -> float:
    """Mean SSIM of two images' luminance. Local statistics by scipy's gaussian_filter; the mean is over pixels whose
    whole window lies inside the image (as Wang et al.'s 'valid' filtering), so the borders' reflection does not
    count. Equal images give exactly 1.0: every term of the ratio is then computed by the same operations."""
    x, y = luminance(run_image), luminance(reference_image)
    if x.shape != y.shape:
        raise ValueError(f"images differ in shape: {x.shape} and {y.shape}")
    c1, c2 = (SSIM_K1 * SSIM_L) ** 2, (SSIM_K2 * SSIM_L) ** 2

    def blur(a):
        return gaussian_filter(a, sigma=SSIM_SIGMA, truncate=SSIM_TRUNCATE, mode="reflect")

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x * mu_x
    var_y = blur(y * y) - mu_y * mu_y
    cov = blur(x * y) - mu_x * mu_y
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2))
    pad = int(SSIM_TRUNCATE * SSIM_SIGMA + 0.5)
    if min(x.shape) <= 2 * pad:
        raise ValueError(f"images of {x.shape} are too small for an SSIM window of radius {pad}")
    return float(index[pad:-pad, pad:-pad].mean())


def _masks(objects, shape: tuple[int, int]) -> np.ndarray:
    """The objects' masks as an (n, H*W) float array (float: intersections as one matrix product, exact to 2**53)."""
    if not objects:
        return np.zeros((0, shape[0] * shape[1]))
    masks = [np.asarray(obj.mask, dtype=bool) for obj in objects]
    for mask in masks:
        if mask.shape != shape:
            raise ValueError(f"an object's mask is {mask.shape}, the image {shape}")
    return np.stack(masks).reshape(len(masks), -1).astype(np.float64)


def _iou_matrix(reference: np.ndarray, run: np.ndarray) -> np.ndarray:
    """IoU of every reference mask (rows) with every run mask (columns); 0 where both are empty."""
    inter = reference @ run.T
    union = reference.sum(axis=1)[:, None] + run.sum(axis=1)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def image_fidelity(run_image, reference_image, run_reading, reference_reading) -> dict[str, float]:
    """The five metrics of one case, in METRICS' order. Each reference object is matched to the run object with the
    highest IoU with it (matched where that IoU > 0; a run object may match several: a merged pair is then penalised
    by IoU, not hidden). mask_iou: mean over the reference's objects of that IoU (0 for an unmatched one); where the
    reference has no object, the IoU of the union masks (1.0 when both are empty: nothing drawn, nothing lost).
    centroid_shift (px), colour_distance (Euclidean, 8-bit RGB) and frequency_error (|f_run - f_ref|): means over the
    matched objects, NaN where none matched (no pair to compare, which mask_iou already counts)."""
    reference_image, run_image = np.asarray(reference_image), np.asarray(run_image)
    if run_image.shape != reference_image.shape:
        raise ValueError(f"images differ in shape: {run_image.shape} and {reference_image.shape}")
    shape = reference_image.shape[:2]
    ref_objects, run_objects = tuple(reference_reading.objects), tuple(run_reading.objects)
    ref_masks, run_masks = _masks(ref_objects, shape), _masks(run_objects, shape)

    nan = float("nan")
    result = {"centroid_shift": nan, "colour_distance": nan, "frequency_error": nan}
    if not ref_objects:
        ref_union, run_union = ref_masks.any(axis=0), run_masks.any(axis=0)
        union = np.logical_or(ref_union, run_union).sum()
        iou = 1.0 if union == 0 else float(np.logical_and(ref_union, run_union).sum() / union)
        result["mask_iou"] = iou
    else:
        ious = _iou_matrix(ref_masks, run_masks) if run_objects else np.zeros((len(ref_objects), 1))
        best = ious.argmax(axis=1)  # first of equals: deterministic
        best_iou = ious[np.arange(len(ref_objects)), best]
        result["mask_iou"] = float(best_iou.mean())
        pairs = [(ref_objects[i], run_objects[best[i]]) for i in np.flatnonzero(best_iou > 0)]
        if pairs:
            result["centroid_shift"] = float(np.mean([
                math.dist(tuple(map(float, run.centroid)), tuple(map(float, ref.centroid))) for ref, run in pairs]))
            result["colour_distance"] = float(np.mean([
                math.dist(tuple(map(float, run.rgb)), tuple(map(float, ref.rgb))) for ref, run in pairs]))
            result["frequency_error"] = float(np.mean([
                abs(float(run.frequency) - float(ref.frequency)) for ref, run in pairs]))
    result["ssim"] = ssim(run_image, reference_image)
    return {metric: result[metric] for metric in METRICS}


def loss(metric: str, value: float | None) -> float:
    """A metric's value as a loss (lower is better), so that every metric is tested in the same direction. None and
    NaN give NaN."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    value = float("nan") if value is None else float(value)
    return 1.0 - value if metric in HIGHER_IS_BETTER else value


def _values(values) -> np.ndarray:
    """Values as a 1-D float array, NaNs (and Nones) dropped."""
    array = np.asarray([np.nan if v is None else v for v in values], dtype=np.float64).reshape(-1)
    return array[~np.isnan(array)]


def _bootstrap(array: np.ndarray, rounds: int, seed: int, level: float) -> dict:
    """Percentile bootstrap of the mean of `array` (NaN-free): one (rounds x n) index matrix from Generator(seed),
    so the interval is the same on every run and machine for the same values."""
    n = int(array.size)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "n": 0}
    if rounds < 1 or not 0 < level < 1:
        raise ValueError(f"need rounds >= 1 and 0 < level < 1, got {rounds} and {level}")
    rng = np.random.Generator(np.random.PCG64(seed))
    means = array[rng.integers(0, n, size=(rounds, n))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(array.mean()), "low": float(low), "high": float(high), "n": n}


def interval_text(figures: dict | None, digits: int = 4) -> str:
    """A mean and its interval (bootstrap_mean's or paired_excess's dict) as "mean [low, high]"; "—" for none."""
    if not figures or figures.get("mean") is None:
        return "—"
    return f"{figures['mean']:.{digits}f} [{figures['low']:.{digits}f}, {figures['high']:.{digits}f}]"


def bootstrap_mean(values, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean over images with its percentile bootstrap interval ({"mean", "low", "high", "n"}). NaNs (images where a
    metric is undefined) are dropped first; n is how many were used; with none, mean/low/high are None."""
    return _bootstrap(_values(values), rounds, seed, level)


def paired_excess(run_losses, floor_losses, margin: float, rounds: int = 2000, seed: int = 0,
                  level: float = 0.95) -> dict:
    """The paired test of a run against the noise floor on the same cases: d = run_loss - floor_loss per case (cases
    where either is NaN dropped), the bootstrap interval of mean(d), and "flagged" where its low end exceeds `margin`:
    with `level` confidence the run differs from the reference by more than two exact runs do, plus the margin.
    Paired because the cases' difficulty varies far more than the paths do: per-case differences cancel it."""
    run = np.asarray([np.nan if v is None else v for v in run_losses], dtype=np.float64).reshape(-1)
    floor = np.asarray([np.nan if v is None else v for v in floor_losses], dtype=np.float64).reshape(-1)
    if run.shape != floor.shape:
        raise ValueError(f"run and floor have {run.size} and {floor.size} cases: they must be the same cases")
    d = run - floor
    result = _bootstrap(d[~np.isnan(d)], rounds, seed, level)
    result["margin"] = float(margin)
    result["flagged"] = result["low"] is not None and result["low"] > margin
    return result


def summarise_fidelity(per_case: Sequence[dict[str, float]], floor_per_case: Sequence[dict[str, float]] | None,
                       rounds: int = 2000, seed: int = 0) -> dict:
    """Per metric (METRICS' order): {"value": bootstrap_mean of its values, "excess": paired_excess of its losses
    against the floor's with MARGINS[metric], or None without a floor}. "flagged": whether any metric is (None
    without a floor: nothing was tested), "flagged_by": those metrics. `floor_per_case`: the same cases in the same
    order, each the fidelity of a second exact run to the reference. A metric missing from a case counts as NaN."""
    if floor_per_case is not None and len(floor_per_case) != len(per_case):
        raise ValueError(f"{len(per_case)} cases and {len(floor_per_case)} floor cases: they must be the same cases")
    summary: dict = {}
    flagged_by = []
    for metric in METRICS:
        values = [case.get(metric) for case in per_case]
        entry = {"value": bootstrap_mean(values, rounds=rounds, seed=seed), "excess": None}
        if floor_per_case is not None:
            entry["excess"] = paired_excess([loss(metric, v) for v in values],
                                            [loss(metric, case.get(metric)) for case in floor_per_case],
                                            MARGINS[metric], rounds=rounds, seed=seed)
            if entry["excess"]["flagged"]:
                flagged_by.append(metric)
        summary[metric] = entry
    summary["flagged"] = None if floor_per_case is None else bool(flagged_by)
    summary["flagged_by"] = flagged_by
    return summary
