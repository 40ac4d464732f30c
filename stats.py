"""Small statistics for the studies: means, spreads, 95% confidence intervals and what they say."""

from __future__ import annotations

import math

import numpy as np


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 with one value)."""
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


# Two-sided 95% quantiles of Student's t with 1..30 degrees of freedom (standard tables); 1.96 beyond.
T_975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
NO_EFFECT = 0.01  # nats: an effect whose whole confidence interval lies within +-0.01 is "no effect"


def confidence_interval(values: list[float]) -> tuple[float, float]:
    """95% confidence interval of the mean of `values` (Student's t); infinite with fewer than 2."""
    if len(values) < 2:
        return -math.inf, math.inf
    mean, sd = mean_spread(values)
    half = (T_975[len(values) - 2] if len(values) <= 31 else 1.96) * sd / math.sqrt(len(values))
    return mean - half, mean + half


def verdict(interval: tuple[float, float]) -> str:
    """What a confidence interval of a loss difference says: the variant "hurts" (raises the loss) or
    "helps", "no effect" when the whole interval lies within +-NO_EFFECT, else "unresolved"."""
    low, high = interval
    if -NO_EFFECT <= low and high <= NO_EFFECT:
        return "no effect"
    if low > 0:
        return "hurts"
    if high < 0:
        return "helps"
    return "unresolved"
