"""Cost models t(N) fitted to the measured medians, and the break-even ratios they give.

Cost models (STree paper, section 4): t = k*N + C (linear, pure SSM targets) and
t = a*N^2 + b*N + c (quadratic, hybrids with attention), least squares on the medians of the
verify calls (N >= 2; the AR step is a separate code path and is reported beside them), with
every coefficient held >= 0: each is a cost (per call, per token, per token pair), and a fit
with a negative one predicts times that fall with N or drop below zero, which noisy medians
otherwise produce. Both are reported with R^2 and residuals; `primary` names the one that matches the architecture. A tree
of N2 nodes beats the reference call of N1 nodes when tau2 / tau1 >= t(N2) / t(N1), with tau
the mean accepted tokens per target call; the break-even table gives that ratio over the
measured range, the reference being the ``chain`` method at N1 (vanilla speculative decoding,
as in the paper's figure 2c) when chain was measured, else the same method.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InputError

COST_MODELS = {"linear": ("k", "C"), "quadratic": ("a", "b", "c")}
"""The coefficients of each cost model: t = k*N + C and t = a*N^2 + b*N + c."""
MIN_FIT_SIZES = max(len(names) for names in COST_MODELS.values())
"""Distinct sizes both cost models need: with fewer, a fit passes through every point (R^2 = 1) and
predicts nothing."""


@dataclass
class Fit:
    """A polynomial cost model t(N) fitted by least squares."""

    kind: str
    """linear (t = k*N + C) or quadratic (t = a*N^2 + b*N + c)."""
    coef: dict[str, float]
    r2: float
    residuals: list[float]
    """measured - fitted, in the order of the sizes given."""

    def __call__(self, n):
        n = np.asarray(n, dtype=float)
        if self.kind == "linear":
            return self.coef["k"] * n + self.coef["C"]
        return self.coef["a"] * n**2 + self.coef["b"] * n + self.coef["c"]

    def to_dict(self) -> dict:
        return {"coef": dict(self.coef), "r2": self.r2, "residuals": list(self.residuals)}

    @classmethod
    def from_dict(cls, kind: str, d: dict) -> "Fit":
        return cls(kind, {k: float(v) for k, v in d["coef"].items()}, float(d["r2"]), [float(r) for r in d["residuals"]])


def r_squared(y: np.ndarray, fitted: np.ndarray) -> float:
    """1 - SS_res / SS_tot; 1.0 for a perfect fit of constant data, 0.0 for an imperfect one."""
    y, fitted = np.asarray(y, float), np.asarray(fitted, float)
    ss_res = float(((y - fitted) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot == 0.0:
        return 1.0 if ss_res <= 1e-24 * max(1.0, float((y**2).sum())) else 0.0
    return 1.0 - ss_res / ss_tot


def fit_cost_model(sizes: Sequence[float], times: Sequence[float], kind: str) -> Fit:
    """Least-squares fit of t = k*N + C (`linear`) or t = a*N^2 + b*N + c (`quadratic`), coefficients >= 0.

    Where the unconstrained fit has no negative coefficient it is the answer; otherwise the best
    fit with some coefficients held at 0 (see `nonnegative_lstsq`), so t(N) >= 0 and never
    decreases for N >= 0. With fewer distinct sizes than coefficients the system is
    underdetermined; numpy's lstsq then returns the minimum-norm solution, and R^2 is still reported
    (`ProfileSettings.validate` asks for MIN_FIT_SIZES sizes, so a profile never has such a fit).
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if n.shape != t.shape or n.ndim != 1 or n.size == 0:
        raise InputError("fit needs equally long, non-empty lists of sizes and times")
    if kind not in COST_MODELS:
        raise InputError(f"unknown fit kind {kind!r}; use linear or quadratic")
    names = COST_MODELS[kind]
    powers = [n**p for p in range(len(names) - 1, -1, -1)]  # N^2, N, 1 for the quadratic
    design = np.stack(powers, axis=1)
    coef = nonnegative_lstsq(design, t)
    fitted = design @ coef
    return Fit(kind, {k: float(v) for k, v in zip(names, coef)}, r_squared(t, fitted), [float(r) for r in t - fitted])


def nonnegative_lstsq(design: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin |design @ x - t| over x >= 0, for the few columns of a cost model.

    The optimum of a non-negative least-squares problem is the unconstrained optimum on the
    columns it leaves non-zero, so trying every subset of columns (the others held at 0) and
    keeping the best one whose coefficients are all >= 0 is exact; with 2 or 3 columns that is
    at most 7 small solves. The full set is tried first, so an unconstrained fit that is already
    non-negative is returned unchanged.
    """
    width = design.shape[1]
    best, best_ss = np.zeros(width), float(t @ t)
    for size in range(width, 0, -1):
        for cols in itertools.combinations(range(width), size):
            sub, *_ = np.linalg.lstsq(design[:, cols], t, rcond=None)
            if (sub < 0).any():
                continue
            coef = np.zeros(width)
            coef[list(cols)] = sub
            ss = float(((t - design @ coef) ** 2).sum())
            if ss < best_ss - 1e-12 * max(best_ss, 1e-30):
                best, best_ss = coef, ss
    return best


def primary_fit_kind(architecture: str) -> str:
    """The STree paper's choice: linear for pure SSMs, quadratic once attention is present."""
    return "quadratic" if architecture == "hybrid" else "linear"


def break_even_ratio(fit2: Fit, n2, fit1: Fit, n1: float):
    """tau2 / tau1 that a call of n2 tokens needs to beat one of n1 tokens: t2(n2) / t1(n1)."""
    return fit2(n2) / float(fit1(n1))


def fitted_sizes(sizes: Sequence[int]) -> list[int]:
    """The sizes a cost model is fitted on: the verify calls (N >= 2) when there are MIN_FIT_SIZES or more.

    Size 1 is the autoregressive step, a different code path (`model.step`, a fused single-token
    update) that on a GPU costs about half of the smallest verify call; fitting it together with
    the verify calls would bend both models. It stays in the timings, the plot and the
    break-even table's `ratio_vs_ar`.
    """
    verify = [n for n in sizes if n >= 2]
    return verify if len(verify) >= MIN_FIT_SIZES else list(sizes)


def compute_fits(timings: dict, architecture: str) -> dict:
    """Both cost models per method, on `fitted_sizes`, with the architecture's primary named."""
    fits = {}
    for method, rows in timings.items():
        used = fitted_sizes([r["size"] for r in rows])
        med = [r["median"] for r in rows if r["size"] in used]
        fits[method] = {"primary": primary_fit_kind(architecture), "sizes": used,
                        "linear": fit_cost_model(used, med, "linear").to_dict(),
                        "quadratic": fit_cost_model(used, med, "quadratic").to_dict()}
    return fits


LOW_R2 = 0.9
"""A primary fit with R^2 below this (and residuals that matter, see `fit_warnings`) is reported."""
SMALL_RESIDUAL = 0.05
"""Residuals under this fraction of the mean median are noise however low R^2 is."""


def fit_warnings(fits: dict, timings: dict) -> list[str]:
    """A sentence per method whose primary fit does not explain the measured medians.

    Low R^2 alone is not enough: medians that hardly change with N (a call dominated by fixed
    overhead) have little variance to explain, so R^2 is low while every residual is tiny. A
    fit is reported when R^2 < 0.9 and the residuals' RMS exceeds 5% of the mean median.
    """
    out = []
    for method, f in fits.items():
        primary = f[f["primary"]]
        used = set(f["sizes"])
        medians = np.array([r["median"] for r in timings[method] if r["size"] in used], float)
        rms = float(np.sqrt(np.mean(np.square(primary["residuals"]))))
        if primary["r2"] < LOW_R2 and rms > SMALL_RESIDUAL * float(np.mean(medians)):
            out.append(
                f"the {f['primary']} fit of {method} explains the medians poorly (R^2 {primary['r2']:.2f}, "
                f"residual RMS {rms:.3g} ms of {float(np.mean(medians)):.3g} ms): its predictions and break-even "
                "ratios are unreliable; re-run on an idle machine or with more --repeats"
            )
    return out


def compute_break_even(fits: dict, timings: dict, reference_n: int) -> dict:
    """tau2/tau1 >= t(N2)/t_ref(N1) over each method's fitted range, and t(N2)/t_AR.

    The reference is the chain method at N1 (vanilla speculative decoding) when measured, else
    each method at N1. `ratio_vs_ar` is the mean accepted tokens per call a tree of N2 nodes
    needs just to match plain autoregressive decoding (whose tau is 1), drafting not counted.
    """
    ref_method = "chain" if "chain" in fits else None
    table = {}
    ref_ms_out = None
    for method, f in fits.items():
        rm = ref_method or method
        ref_fit = Fit.from_dict(fits[rm]["primary"], fits[rm][fits[rm]["primary"]])
        fit = Fit.from_dict(f["primary"], f[f["primary"]])
        used = f.get("sizes") or [r["size"] for r in timings[method]]
        ar = next((r["median"] for r in timings[method] if r["size"] == 1), None)
        ref_ms = float(ref_fit(reference_n))
        if rm == ref_method or ref_method is None:
            ref_ms_out = ref_ms
        rows = []
        for n2 in range(min(used), max(used) + 1):
            t2 = float(fit(n2))
            # A non-positive predicted time (all-zero medians, or a profile written before fits were
            # held non-negative) gives no usable ratio.
            ok = t2 > 0 and ref_ms > 0
            rows.append({"n": n2, "ratio": t2 / ref_ms if ok else None,
                         "ratio_vs_ar": t2 / ar if ok and ar is not None and ar > 0 else None})
        table[method] = rows
    return {"reference_n": reference_n, "reference_method": ref_method or "same",
            "reference_ms": ref_ms_out, "table": table}


def by_width(widths: Sequence[int], ms: Sequence[float], width: float) -> float:
    """A cost measured at some widths, at any width: piecewise-linear through the points (ascending
    widths), the first point's cost below them; past them, extended along the last segment but
    never below the last point's cost (a noisy segment may slope down), or along the line through
    the origin with a single point.

    Used for drafter levels (profile.json's drafter_timings.levels): their cost by batch width.
    """
    if not widths:
        raise InputError("no measured widths to interpolate")
    if len(widths) == 1:
        return ms[0] * width / widths[0] if width > widths[0] else ms[0]
    if width <= widths[0]:
        return ms[0]
    i = next((i for i in range(1, len(widths)) if width <= widths[i]), len(widths) - 1)
    w0, w1, m0, m1 = widths[i - 1], widths[i], ms[i - 1], ms[i]
    value = m0 + (m1 - m0) * (width - w0) / (w1 - w0)
    return max(value, ms[-1]) if width > widths[-1] else value
