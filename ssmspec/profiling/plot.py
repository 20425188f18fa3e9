"""The profile's PNG: measured medians and fitted curves, and the break-even ratios."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .fits import Fit
from .schema import Profile

_COLORS = {"stree": "tab:blue", "unrolled": "tab:orange", "chain": "tab:green"}


def plot_profile(profile: dict | Profile, path: str | Path, title: str | None = None) -> Path:
    """PNG: measured medians with IQR bars and fitted curves (left), break-even ratio (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = profile.data if isinstance(profile, Profile) else profile
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    _draw_call_times(ax, d)
    _draw_break_even(ax2, d["break_even"])
    t = d["target"]
    src = t.get("source") or t["config"].get("d_model")
    fig.suptitle(title or f"ssmspec profile: {src} ({t['architecture']}, {d['dtype']}, batch "
                 f"{d['settings']['batch']}) on {d['device']['name']}", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_call_times(ax, d: dict) -> None:
    """Medians with IQR bars of the fitted (verify) sizes, both fits, and the AR step as a star."""
    import matplotlib.ticker

    ar_drawn = False
    for method, rows in d["timings"].items():
        color = _COLORS.get(method)
        f = d["fits"][method]
        used = set(f.get("sizes") or [r["size"] for r in rows])
        pts = [r for r in rows if r["size"] in used]
        n = np.array([r["size"] for r in pts], float)
        med = np.array([r["median"] for r in pts])
        lo = med - np.array([r.get("q1", r["median"]) for r in pts])
        hi = np.array([r.get("q3", r["median"]) for r in pts]) - med
        ax.errorbar(n, med, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], fmt="o", color=color, capsize=3,
                    ms=4, label=f"{method} verify+replay (median, IQR)")
        grid = np.linspace(n.min(), n.max(), 200)
        for kind, style in (("linear", "-"), ("quadratic", ":")):
            fit = Fit.from_dict(kind, f[kind])
            primary = kind == f["primary"]
            ax.plot(grid, fit(grid), style, color=color, alpha=0.9 if primary else 0.5, lw=1.6 if primary else 1.0,
                    label=f"{method} {_fit_label(fit)}" + (" *" if primary else ""))
        ar = [r for r in rows if r["size"] == 1 and r["size"] not in used]
        if ar and not ar_drawn:
            ax.plot([1], [ar[0]["median"]], "k*", ms=11, label=f"AR step (model.step): {ar[0]['median']:.3g} ms")
            ar_drawn = True
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))  # 1, 2, 4 not 2^k
    ax.set_xlabel("input size N (tree nodes; chain: tokens)")
    ax.set_ylabel("time per call (ms)")
    ax.set_title("target call time; fits on verify calls, * = primary")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def _draw_break_even(ax2, be: dict) -> None:
    """Required tau2 / tau1 against tree size: vs the reference call (solid) and vs the AR step (dashed)."""
    for method, rows in be["table"].items():
        nan = float("nan")  # unusable ratios (None) leave gaps
        ax2.plot([r["n"] for r in rows], [nan if r["ratio"] is None else r["ratio"] for r in rows],
                 color=_COLORS.get(method), label=f"{method} vs {be['reference_method']} at N1")
        if any(r.get("ratio_vs_ar") is not None for r in rows):
            ax2.plot([r["n"] for r in rows], [nan if r.get("ratio_vs_ar") is None else r["ratio_vs_ar"] for r in rows],
                     "--", lw=1.0, alpha=0.6, color=_COLORS.get(method), label=f"{method} vs AR step")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax2.axvline(be["reference_n"], color="grey", lw=0.8, ls=":")
    ref = be["reference_method"]
    ax2.set_xlabel("tree size N2 (nodes)")
    ax2.set_ylabel(f"required tau2 / tau1 (solid: vs {ref} at N1 = {be['reference_n']})")
    ax2.set_title("break-even acceptance ratio t(N2) / t(N1)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)


def _fit_label(fit: Fit) -> str:
    c = fit.coef
    if fit.kind == "linear":
        return f"{c['k']:.3g}N {c['C']:+.3g} (R²={fit.r2:.3f})"
    return f"{c['a']:.2g}N² {c['b']:+.3g}N {c['c']:+.3g} (R²={fit.r2:.3f})"
