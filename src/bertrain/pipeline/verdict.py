"""Does pretraining help? One task's verdict from its primary metric's per-seed dev scores, pretrained vs random init.

The rule (`decide`), applied in this order:

0. A score that is not a number (NaN, inf: e.g. the Pearson correlation of constant or NaN predictions) on either
   side: "inconclusive" — a mean, a spread or an interval over it is no measurement, and without this rule a NaN
   interval failed every comparison and read as "pretraining hurts".
1. Fewer than 2 seeds on a side: "inconclusive" — one score has no spread, so no difference can be told from the
   noise of seeds.
2. Both sides at chance: "inconclusive". A side is *at chance* when its mean is less than 5 points of the metric
   (`CHANCE_MARGIN_POINTS`: 0.05 on a 0-1 scale, 5.0 in percent) above the chance level; below chance counts too.
   Two models that both score within a few points of the majority class (or of zero correlation) have learned
   nothing worth comparing, however tight their seeds. Not applied when the chance level is unknown.
3. The 95% interval of the difference of means (pretrained - random) covers zero: "inconclusive". The interval is
   Welch's t interval over seeds (unequal variances; Welch-Satterthwaite degrees of freedom), so with 2-3 seeds
   per side it is wide unless the seeds agree.
4. Otherwise "pretraining helps" (interval above zero) or "pretraining hurts" (interval below zero).

Pure: numbers in, a `Verdict` out; the evaluate stage stores it in results.json and the report renders it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

CHANCE_MARGIN_POINTS = 5.0
"""How far above the chance level a side's mean must be (in points: percent, or hundredths of a correlation) not to
count as "at chance"."""

CONFIDENCE = 0.95

HELPS, HURTS, INCONCLUSIVE = "pretraining helps", "pretraining hurts", "inconclusive"

RULE = (f"non-finite scores inconclusive; min 2 seeds a side; chance margin {CHANCE_MARGIN_POINTS:g} points; "
        f"Welch {CONFIDENCE:.0%} interval")
"""The rule in one line: part of the evaluate stage's hash, so a run folder scored under another rule is re-scored."""


@dataclass(frozen=True)
class Verdict:
    """All numbers are in the metric's own units (GLUE: fractions, SQuAD: percent)."""

    outcome: str  # HELPS, HURTS or INCONCLUSIVE
    reason: str  # why, in a few words
    seeds: dict[str, int]  # {"pretrained": n, "random": n}
    means: dict[str, float | None]  # each side's mean over seeds (None: no seeds)
    difference: float | None  # mean(pretrained) - mean(random)
    interval: tuple[float, float] | None  # its CONFIDENCE interval (None: fewer than 2 seeds on a side)
    method: str | None  # how the interval was computed
    confidence: float
    chance: float | None  # the chance level (None: unknown — then rule 2 is not applied)
    chance_source: str  # what the chance level is, e.g. "majority class"
    margin: float  # rule 2's margin above chance


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Welch's t interval for mean(a) - mean(b); needs at least 2 values on each side."""
    from scipy.stats import t  # a dependency already (GLUE's correlations); imported here: it is slow to import

    diff = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:  # every seed scored the same on both sides: the difference is exact as far as seeds tell
        return diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    half = float(t.ppf(0.5 + confidence / 2, df)) * se
    return diff - half, diff + half


def decide(pretrained: Sequence[float], random: Sequence[float], chance: float | None, chance_source: str = "",
           points_per_unit: float = 100.0, confidence: float = CONFIDENCE) -> Verdict:
    """The verdict of the module docstring for one task's per-seed scores of its primary metric.

    `points_per_unit`: 100 for scores on a 0-1 scale (GLUE), 1 for percent (SQuAD); it converts the margin."""
    margin = CHANCE_MARGIN_POINTS / points_per_unit
    p, r = [float(v) for v in pretrained], [float(v) for v in random]
    means = {"pretrained": statistics.fmean(p) if p else None, "random": statistics.fmean(r) if r else None}
    diff = means["pretrained"] - means["random"] if p and r else None
    common = dict(seeds={"pretrained": len(p), "random": len(r)}, means=means, difference=diff,
                  confidence=confidence, chance=chance, chance_source=chance_source, margin=margin)
    not_finite = {side: sum(not math.isfinite(x) for x in v) for side, v in (("pretrained", p), ("random-init", r))}
    bad = [f"{n} {side} seed{'s' * (n != 1)}" for side, n in not_finite.items() if n]
    if bad:  # rule 0: no difference, no interval over a score that is not a number
        common.update(difference=None)
        return Verdict(INCONCLUSIVE, f"{' and '.join(bad)} scored no number (NaN or inf)", interval=None, method=None,
                       **common)
    if len(p) < 2 or len(r) < 2:
        if not r:
            reason = "no random-init runs to compare with"
        elif len(p) == len(r) == 1:
            reason = "one seed per side: no spread"
        else:
            reason = ", ".join(f"{len(v)} {side} seed{'s' * (len(v) != 1)}" for side, v in
                               (("pretrained", p), ("random-init", r)) if len(v) < 2) + ": no spread"
        return Verdict(INCONCLUSIVE, reason, interval=None, method=None, **common)
    interval = welch_interval(p, r, confidence)
    common.update(interval=interval, method="Welch t interval over seeds")
    if chance is not None and all(m < chance + margin for m in (means["pretrained"], means["random"])):
        return Verdict(INCONCLUSIVE, f"both at chance: each mean less than {CHANCE_MARGIN_POINTS:g} points "
                                     "above it", **common)
    lo, hi = interval
    if lo <= 0.0 <= hi:
        return Verdict(INCONCLUSIVE, f"the {100 * confidence:g}% interval covers zero", **common)
    return Verdict(HELPS if lo > 0 else HURTS, f"the {100 * confidence:g}% interval excludes zero", **common)
