"""Tests of `ssmspec profile`: timing harness, cost-model fits, break-even math, profile.json, CLI."""
from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
import torch

from helpers import tiny_model
from ssmspec import profiling
from ssmspec.errors import InputError, ProfileMismatchError
from ssmspec.trees import Tree
from ssmspec.profiling import (
    Fit, ProfileSettings, Timing, balanced_tree, check_profile_matches, compute_break_even, compute_fits,
    default_cpu_threads, fit_cost_model, fit_warnings, load_profile, r_squared, run_profile, samples_disagree,
    save_profile, time_call,
)

SIZES = [1, 2, 4, 8, 16, 32, 64]
HYBRID = ("mamba", "attention", "mlp", "mamba")


def _timings(sizes, times):
    return {"stree": [{"size": n, "median": t} for n, t in zip(sizes, times)]}


# -- timing harness ----------------------------------------------------------------------------
def test_time_call_cpu_counts_calls_and_summarises():
    calls = []
    t = time_call(lambda: calls.append(1), warmup=2, repeats=5, device="cpu")
    assert len(calls) == 7
    assert len(t.samples) == 5 and t.mode == "eager" and t.note is None
    assert t.min <= t.q1 <= t.median <= t.q3 <= t.max
    assert t.iqr == pytest.approx(t.q3 - t.q1)
    d = t.to_dict()
    assert d["samples"] == t.samples and d["median"] == t.median


def test_time_call_measures_sleep():
    import time

    t = time_call(lambda: time.sleep(0.004), warmup=0, repeats=3)
    assert 3.9 <= t.median < 50


def test_time_call_setup_runs_before_each_call_untimed():
    import time

    order = []
    t = time_call(lambda: order.append("call"), warmup=1, repeats=3,
                  setup=lambda: (order.append("setup"), time.sleep(0.01)))
    assert order == ["setup", "call"] * 4
    assert t.max < 5  # the 10 ms of setup are outside the timed window
    from ssmspec.profiling.timing import time_call as harness  # where benchmarks import it from

    assert harness is time_call


def test_time_call_rejects_zero_repeats():
    with pytest.raises(InputError):
        time_call(lambda: None, repeats=0)


@pytest.mark.requires_cuda
def test_time_call_cuda_graph_and_fallback():
    x = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(x)
    t = time_call(lambda: torch.mm(x, x, out=out), warmup=2, repeats=5, device="cuda", cuda_graph=True)
    assert t.mode == "cuda_graph" and len(t.samples) == 5 and t.median > 0
    syncing = time_call(lambda: (x.sum().item()), warmup=1, repeats=3, device="cuda", cuda_graph=True)
    assert syncing.mode == "eager" and "capture failed" in syncing.note
    # the failed capture must leave CUDA usable: a captured call still works afterwards
    again = time_call(lambda: torch.mm(x, x, out=out), warmup=1, repeats=3, device="cuda", cuda_graph=True)
    assert again.mode == "cuda_graph"


@pytest.mark.requires_cuda
def test_time_call_cuda_setup_runs_outside_the_graph():
    x = torch.zeros(1, device="cuda")
    calls = []

    def setup():
        calls.append(1)
        x.zero_()

    t = time_call(lambda: x.add_(1), warmup=1, repeats=4, device="cuda", cuda_graph=True, setup=setup)
    torch.cuda.synchronize()
    assert t.mode == "cuda_graph" and len(t.samples) == 4
    assert x.item() == 1  # each replay adds one to what the setup before it reset
    assert len(calls) == 1 + 2 + 1 + 4  # eager warm-up, capture (before its eager call and its replay), graph warm-up, timed


# -- fits ----------------------------------------------------------------------------------------
def test_linear_fit_recovers_exact_coefficients():
    times = [0.25 * n + 3.0 for n in SIZES]
    f = fit_cost_model(SIZES, times, "linear")
    assert f.coef["k"] == pytest.approx(0.25, rel=1e-9)
    assert f.coef["C"] == pytest.approx(3.0, rel=1e-9)
    assert f.r2 == pytest.approx(1.0, abs=1e-12)
    assert max(abs(r) for r in f.residuals) < 1e-9
    assert f(10) == pytest.approx(5.5)


def test_quadratic_fit_recovers_exact_coefficients():
    times = [0.002 * n * n + 0.1 * n + 4.0 for n in SIZES]
    f = fit_cost_model(SIZES, times, "quadratic")
    for name, want in (("a", 0.002), ("b", 0.1), ("c", 4.0)):
        assert f.coef[name] == pytest.approx(want, rel=1e-7)
    assert f.r2 == pytest.approx(1.0, abs=1e-12)
    # The linear model cannot follow the curvature: a lower R^2 and structured residuals.
    lin = fit_cost_model(SIZES, times, "linear")
    assert lin.r2 < f.r2 and lin.r2 < 0.999
    assert lin.residuals[0] > 0 and lin.residuals[-1] > 0  # convex data above the chord at both ends


def test_fits_with_noise_within_stated_tolerance():
    # t = 0.05 N + 5 ms plus N(0, 0.02 ms) noise, three measurements per size. Over these sizes
    # the standard error of k is 0.02 / sqrt(3 * Sxx) ~ 2.1e-4 and of C ~ 5.7e-3; the tolerances
    # (2e-3 and 0.05) are about 9 standard errors, so the test is deterministic in practice and
    # still fails for any real bias in the fit.
    rng = np.random.default_rng(1234)
    n = np.repeat(SIZES, 3).astype(float)
    t = 0.05 * n + 5.0 + rng.normal(0, 0.02, n.shape)
    f = fit_cost_model(n, t, "linear")
    assert abs(f.coef["k"] - 0.05) < 2e-3
    assert abs(f.coef["C"] - 5.0) < 0.05
    assert f.r2 > 0.99
    assert np.std(f.residuals) == pytest.approx(0.02, rel=0.5)
    # Quadratic data with 1% multiplicative noise: a within 20%, b within 0.05, c within 0.3.
    tq = (0.003 * n**2 + 0.2 * n + 6.0) * (1 + rng.normal(0, 0.01, n.shape))
    q = fit_cost_model(n, tq, "quadratic")
    assert abs(q.coef["a"] - 0.003) < 0.2 * 0.003
    assert abs(q.coef["b"] - 0.2) < 0.05
    assert abs(q.coef["c"] - 6.0) < 0.3
    assert q.r2 > fit_cost_model(n, tq, "linear").r2


def test_r_squared_behaviour():
    y = np.array([1.0, 2.0, 4.0, 3.0])
    assert r_squared(y, y) == 1.0
    assert r_squared(y, np.full_like(y, y.mean())) == pytest.approx(0.0)
    assert r_squared(y, y[::-1]) < 0  # worse than predicting the mean
    assert r_squared(np.ones(3), np.ones(3)) == 1.0  # constant data fitted exactly
    assert r_squared(np.ones(3), np.array([1.0, 2.0, 1.0])) == 0.0


def test_fit_rejects_bad_input():
    with pytest.raises(InputError):
        fit_cost_model([1, 2], [1.0], "linear")
    with pytest.raises(InputError):
        fit_cost_model([1, 2], [1.0, 2.0], "cubic")


def test_fits_leave_out_the_ar_step_when_enough_verify_sizes():
    assert profiling.fitted_sizes([1, 2, 4, 8]) == [2, 4, 8]
    assert profiling.fitted_sizes([1, 2, 4]) == [1, 2, 4]  # too few verify sizes for a quadratic
    # A cheap AR step (another code path) must not bend the verify model.
    times = [3.0] + [0.1 * n + 7.0 for n in SIZES[1:]]
    f = compute_fits(_timings(SIZES, times), "ssm")["stree"]
    assert f["sizes"] == SIZES[1:]
    assert f["linear"]["coef"]["k"] == pytest.approx(0.1) and f["linear"]["r2"] == pytest.approx(1.0)
    be = compute_break_even({"stree": f}, _timings(SIZES, times), reference_n=5)
    row = {r["n"]: r for r in be["table"]["stree"]}[20]
    assert row["ratio_vs_ar"] == pytest.approx(9.0 / 3.0) and row["ratio"] == pytest.approx(9.0 / 7.5)


def test_primary_fit_follows_architecture():
    assert profiling.primary_fit_kind("ssm") == "linear"
    assert profiling.primary_fit_kind("hybrid") == "quadratic"
    fits = compute_fits(_timings(SIZES, [n + 1.0 for n in SIZES]), "hybrid")
    assert fits["stree"]["primary"] == "quadratic" and set(fits["stree"]) == {"primary", "sizes", "linear", "quadratic"}


# -- break-even ----------------------------------------------------------------------------------
def test_break_even_ratio_matches_the_papers_formula():
    # Eq. 7 of the STree paper: tau2/tau1 >= (k2 N2 + C2) / (k1 N1 + C1).
    f1 = Fit("linear", {"k": 0.5, "C": 10.0}, 1.0, [])
    f2 = Fit("linear", {"k": 0.2, "C": 12.0}, 1.0, [])
    assert profiling.break_even_ratio(f2, 15, f1, 5) == pytest.approx((0.2 * 15 + 12) / (0.5 * 5 + 10))
    q = Fit("quadratic", {"a": 0.01, "b": 0.1, "c": 8.0}, 1.0, [])
    assert profiling.break_even_ratio(q, 20, f1, 5) == pytest.approx((0.01 * 400 + 2 + 8) / 12.5)


def test_break_even_table_uses_chain_at_reference_n():
    timings = {
        "stree": [{"size": n, "median": 0.1 * n + 10} for n in SIZES],
        "chain": [{"size": n, "median": 0.4 * n + 10} for n in SIZES],
    }
    fits = compute_fits(timings, "ssm")
    be = compute_break_even(fits, timings, reference_n=5)
    assert be["reference_method"] == "chain" and be["reference_n"] == 5
    assert be["reference_ms"] == pytest.approx(12.0)
    stree = {r["n"]: r["ratio"] for r in be["table"]["stree"]}
    chain = {r["n"]: r["ratio"] for r in be["table"]["chain"]}
    assert sorted(stree) == list(range(2, 65))  # the fitted (verify) range
    assert chain[5] == pytest.approx(1.0)
    assert stree[15] == pytest.approx((0.1 * 15 + 10) / 12.0)
    # Without chain each method is its own reference.
    be2 = compute_break_even({"stree": fits["stree"]}, {"stree": timings["stree"]}, reference_n=5)
    assert {r["n"]: r["ratio"] for r in be2["table"]["stree"]}[5] == pytest.approx(1.0)


def test_break_even_refuses_non_positive_fitted_times():
    # A profile written before fits were held non-negative can hold a quadratic that dips below
    # zero; its ratios there are reported as None.
    sizes = [2, 4, 8]
    dipping = Fit("quadratic", {"a": 0.5, "b": -4.0, "c": 7.0}, 0.5, [0.0, 0.0, 0.0])  # < 0 for N in (2.59, 5.41)
    fits = {"stree": {"primary": "quadratic", "sizes": sizes, "quadratic": dipping.to_dict(),
                      "linear": Fit("linear", {"k": 1.0, "C": 0.0}, 0.5, [0.0] * 3).to_dict()}}
    be = compute_break_even(fits, _timings(sizes, [2.0, 1.0, 9.0]), reference_n=2)
    by_n = {r["n"]: r["ratio"] for r in be["table"]["stree"]}
    assert by_n[3] is None and by_n[5] is None
    assert by_n[8] == pytest.approx(dipping(8) / dipping(2))


# Medians like those of a CPU run on a busy machine: bimodal, no trend in N.
SCATTERED = ([2, 4, 8, 16, 32, 64], [12.0, 500.0, 13.0, 480.0, 15.0, 14.0])


@pytest.mark.parametrize("sizes, times", [([2, 4, 8], [2.0, -0.5, 9.0]), SCATTERED,
                                          ([2, 4, 8, 16], [9.0, 7.0, 5.0, 3.0])])
@pytest.mark.parametrize("kind", ["linear", "quadratic"])
def test_fits_never_predict_negative_or_falling_times(sizes, times, kind):
    f = fit_cost_model(sizes, times, kind)
    assert all(v >= 0 for v in f.coef.values()), f.coef
    pred = f(np.arange(1, 257))
    assert (pred >= 0).all() and (np.diff(pred) >= -1e-9).all()
    # the residuals and R^2 are those of the constrained fit
    assert f.residuals == pytest.approx(list(np.asarray(times) - f(np.asarray(sizes, float))))


def test_unconstrained_fits_of_the_same_data_do_go_wrong():
    # What the non-negative fit prevents: plain least squares on these medians.
    assert np.polyval(np.polyfit([2, 4, 8], [2.0, -0.5, 9.0], 2), 4) < 0
    assert np.polyfit([2, 4, 8, 16], [9.0, 7.0, 5.0, 3.0], 1)[0] < 0  # a cost falling with N
    lin = np.polyfit(*SCATTERED, 1)
    assert np.polyval(lin, 256) < 0


def test_nonnegative_lstsq_is_the_constrained_optimum():
    # KKT conditions of min |Dx - t|^2 s.t. x >= 0: x >= 0, gradient >= 0, gradient = 0 where x > 0.
    from ssmspec.profiling.fits import nonnegative_lstsq

    rng = np.random.default_rng(7)
    for trial in range(200):
        n = rng.choice([1, 2, 3, 5, 8, 13, 21, 34], size=rng.integers(3, 8)).astype(float)
        design = np.stack([n**2, n, np.ones_like(n)], axis=1)[:, rng.integers(0, 2):]
        t = rng.normal(0, 10, n.shape) + rng.normal(0, 1) * n
        x = nonnegative_lstsq(design, t)
        grad = design.T @ (design @ x - t)
        scale = 1e-7 * max(1.0, float(np.abs(design.T @ t).max()))
        assert (x >= 0).all()
        assert (grad >= -scale).all(), (trial, x, grad)
        assert (np.abs(grad[x > 1e-12]) <= scale).all(), (trial, x, grad)


# -- warnings --------------------------------------------------------------------------------------
def test_samples_disagree():
    assert not samples_disagree([5.0, 5.2, 5.1, 5.05])
    assert samples_disagree([5.0, 11.0, 5.1])  # max/min > 2
    assert samples_disagree([1.0, 1.0, 1.4, 1.9, 1.95, 1.98])  # max/min < 2 but IQR/median > 0.5
    assert Timing([5.0, 11.0]).disagrees and not Timing([5.0, 5.5]).disagrees


def test_fit_warnings_flag_scattered_medians_but_not_flat_ones():
    sizes, times = SCATTERED
    (w,) = fit_warnings(compute_fits(_timings(sizes, times), "ssm"), _timings(sizes, times))
    assert "stree" in w and "R^2" in w
    # medians within 1% of each other: R^2 is low, but the fit is as good as the data
    rng = np.random.default_rng(0)
    flat = list(5.0 * (1 + rng.uniform(-0.01, 0.01, len(sizes))))
    fits = compute_fits(_timings(sizes, flat), "ssm")
    assert fits["stree"]["linear"]["r2"] < 0.9
    assert fit_warnings(fits, _timings(sizes, flat)) == []
    exact = [0.1 * n + 2 for n in sizes]
    assert fit_warnings(compute_fits(_timings(sizes, exact), "hybrid"), _timings(sizes, exact)) == []


def test_run_profile_warns_when_repeated_timings_disagree(monkeypatch, caplog):
    import ssmspec.profiling.measure as measure

    def erratic(fn, **kwargs):  # the harness on a busy machine: one call in two is 10x slower
        return Timing([1.0, 10.0, 1.1])

    monkeypatch.setattr(measure, "time_call", erratic)
    s = ProfileSettings(sizes=(1, 2, 4), methods=("stree",), repeats=3, warmup=0, prompt_len=4, configs=())
    with caplog.at_level("WARNING", logger="ssmspec.profiling"):
        prof = run_profile(tiny_model(layers=("mamba",)), settings=s)
    profiling.validate_profile(prof)
    (w,) = prof["warnings"]
    assert "disagree" in w and "stree N=2" in w and "10x" in w
    assert [r.getMessage() for r in caplog.records if r.name == "ssmspec.profiling"] == [w]


# -- CPU threads -----------------------------------------------------------------------------------
def test_default_cpu_threads_is_one_unless_the_user_set_omp(monkeypatch):
    from ssmspec.ops import settings

    def setenv(value):  # the environment is read once a process (ops/settings.py): read it again
        if value is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", value)
        settings.environment.cache_clear()

    try:
        setenv(None)
        assert default_cpu_threads() == 1
        setenv("3")
        assert default_cpu_threads() == 3
        for junk in ("", "0", "two"):
            setenv(junk)
            assert default_cpu_threads() == 1
    finally:
        monkeypatch.undo()
        settings.environment.cache_clear()


def test_run_profile_uses_and_reports_its_thread_count_and_restores_it(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    s = ProfileSettings(sizes=(1, 2, 4), methods=("chain",), repeats=1, warmup=0, prompt_len=4, configs=())
    prof = run_profile(tiny_model(layers=("mamba",)), settings=s,
                       progress=lambda *_: seen.append(torch.get_num_threads()))
    assert prof["settings"]["threads"] == 1 and set(seen) == {1} and prof["device"]["name"].endswith(", 1 thread)")
    assert torch.get_num_threads() == before
    s.threads = 2
    prof = run_profile(tiny_model(layers=("mamba",)), settings=s)
    assert prof["settings"]["threads"] == 2 and torch.get_num_threads() == before
    assert prof["device"]["name"].endswith(", 2 threads)")
    with pytest.raises(InputError, match="threads"):
        ProfileSettings(threads=0).validate()


# -- trees ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 15, 16, 63, 64])
def test_balanced_tree_shape(n):
    tree = balanced_tree(n)
    assert tree.num_nodes == n
    assert tree.parents == tuple([-1] + [(i - 1) // 2 for i in range(1, n)])
    assert tree.max_depth == int(math.floor(math.log2(n)))
    depths = {tree.depths[leaf] for leaf in tree.leaves()}
    assert max(depths) - min(depths) <= 1  # near-balanced


# -- run_profile, profile.json -------------------------------------------------------------------
_SMALL = ProfileSettings(sizes=(1, 2, 4), repeats=2, warmup=0, prompt_len=8, configs=((2, 1), (2, 2)))


@pytest.fixture(scope="module")
def hybrid_profile():
    torch.manual_seed(0)
    model = tiny_model(layers=HYBRID)
    drafter = tiny_model(layers=("mamba",), seed=1)
    seen = []
    prof = run_profile(model, settings=_SMALL, drafter=drafter, source="tiny hybrid",
                       progress=lambda label, done, total: seen.append((label, done, total)))
    return model, prof, seen


def test_run_profile_records_everything(hybrid_profile):
    model, prof, seen = hybrid_profile
    profiling.validate_profile(prof)
    assert prof["device"]["type"] == "cpu" and prof["dtype"] == "fp32"
    # graphs were asked for (the default) but a CPU run has none, and says so
    assert _SMALL.cuda_graphs and prof["settings"]["cuda_graphs"] is False
    assert all(r["mode"] == "eager" for rows in prof["timings"].values() for r in rows)
    assert prof["settings"]["threads"] >= 1 and isinstance(prof["warnings"], list)
    assert prof["target"]["architecture"] == "hybrid"
    assert prof["target"]["config"]["layer_counts"] == {"mamba": 2, "attention": 1, "mlp": 1}
    assert set(prof["timings"]) == {"stree", "unrolled", "chain"}
    for method, rows in prof["timings"].items():
        assert [r["size"] for r in rows] == [1, 2, 4]
        assert rows[0]["call"] == "step" and all(r["call"] == "verify+replay" for r in rows[1:])
        assert all(len(r["samples"]) == 2 and r["median"] > 0 for r in rows)
    # unrolled N=4: binary tree 0-(1,2), 1-(3): leaves 2 and 3, rows = leaves, tokens = rows * (depth + 1)
    u4 = prof["timings"]["unrolled"][2]
    assert u4["rows"] == 2 and u4["tokens"] == 2 * 3 and u4["tree"]["leaves"] == 2
    assert prof["timings"]["chain"][2]["tree"]["depth"] == 3
    assert prof["fits"]["stree"]["primary"] == "quadratic"
    d = prof["drafter_timings"]
    assert "FusedGreedyDraft" in d["impl"] and d["root"]["median"] > 0
    # powers of two up to the largest size (4), and the configs' level widths (2, 2, 4)
    assert [r["width"] for r in d["levels"]] == [1, 2, 4]
    assert all(len(r["samples"]) == 2 and r["median"] > 0 for r in d["levels"])
    assert [c["config"] for c in d["configs"]] == [[2, 1], [2, 2]]
    assert d["configs"][0]["widths"] == [2, 2] and d["configs"][1]["widths"] == [2, 4]
    assert d["configs"][1]["nodes"] == 7
    level = {r["width"]: r["median"] for r in d["levels"]}
    c = d["configs"][1]  # 2,2: root + a level of 2 + a level of 4, the deepest level included
    assert c["composed_ms"] == pytest.approx(d["root"]["median"] + level[2] + level[4])
    assert c["predicted_step_ms"] == pytest.approx(c["predicted_verify_ms"] + c["composed_ms"] + d["iteration_overhead_ms"])
    it = d["iteration"]
    assert it["tree"] == [1] and len(it["loop"]["samples"]) == 2 and it["bare"]["median"] > 0
    assert d["iteration_overhead_ms"] == it["overhead_ms"] == pytest.approx(max(it["loop"]["median"] - it["bare"]["median"], 0))
    assert d["lambda_gamma"] == pytest.approx(level[1] / d["target_step_ms"])
    assert d["target_step_ms"] == prof["timings"]["stree"][0]["median"]
    assert seen[-1][0] == "done" and seen[-1][1] == seen[-1][2] == profiling.count_items(_SMALL, True)


def test_run_profile_leaves_prefilled_cache_reusable():
    # replay must not accumulate: the attention cache capacity is prompt + max size + margin,
    # so many repeats at the largest size would overflow it if the length were not reset.
    model = tiny_model(layers=("attention", "mamba"))
    s = ProfileSettings(sizes=(2, 4, 8), methods=("chain",), repeats=20, warmup=2, prompt_len=4, configs=())
    prof = run_profile(model, settings=s)
    assert [len(r["samples"]) for r in prof["timings"]["chain"]] == [20, 20, 20]


def test_profile_json_round_trip(tmp_path, hybrid_profile):
    _, prof, _ = hybrid_profile
    path = save_profile(prof, tmp_path / "sub" / "profile.json")
    loaded = load_profile(path)
    assert loaded.to_dict() == prof
    assert json.loads(path.read_text()) == prof
    save_profile(loaded, tmp_path / "again.json")
    assert load_profile(tmp_path / "again.json").to_dict() == prof
    assert loaded.fit("stree").kind == "quadratic"
    assert loaded.target_ms(2) == pytest.approx(loaded.fit("stree")(2))
    assert loaded.ar_step_ms == prof["timings"]["stree"][0]["median"]
    assert loaded.lambda_gamma == prof["drafter_timings"]["lambda_gamma"]
    from ssmspec.tuning.static import CostModel

    cost = CostModel.from_profile(loaded)  # tune-tree's reading: the bandit's default uses the same draft cost
    assert cost.lambda_gamma == pytest.approx(loaded.lambda_gamma)
    d = prof["drafter_timings"]
    for c in d["configs"]:
        tree = Tree.from_config(c["config"])
        assert cost.draft_ms_of(tree) == pytest.approx(c["composed_ms"])
        assert cost.step_ms(tree) == pytest.approx(c["predicted_step_ms"])


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(version=1), "version 1, which timed bare drafter steps.*re-run `ssmspec profile`"),
    (lambda d: d["drafter_timings"].pop("iteration_overhead_ms"), "iteration_overhead_ms"),
    (lambda d: d.update(schema="other"), "not an ssmspec profile"),
    (lambda d: d.pop("fits"), "fits"),
    (lambda d: d.update(dtype="int8"), "dtype"),
    (lambda d: d["timings"].update(bogus=[]), "bogus"),
    (lambda d: d["timings"]["stree"][0].pop("median"), "median"),
])
def test_load_profile_refuses_malformed(tmp_path, hybrid_profile, breakage, message):
    data = json.loads(json.dumps(hybrid_profile[1]))
    breakage(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=message):
        load_profile(tmp_path / "p.json")


def test_load_profile_missing_or_not_json(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="not valid JSON"):
        load_profile(tmp_path / "bad.json")


def test_mismatch_refused_unless_forced(tmp_path, hybrid_profile):
    model, prof, _ = hybrid_profile
    save_profile(prof, tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert check_profile_matches(loaded, model, torch.float32) == []
    assert check_profile_matches(loaded, model, "fp32") == []
    other = tiny_model(layers=("mamba", "mamba"))
    with pytest.raises(ProfileMismatchError, match="fingerprint") as e:
        check_profile_matches(loaded, other, torch.float32)
    assert "--force" in str(e.value) and "tiny hybrid" in str(e.value)
    with pytest.raises(ProfileMismatchError, match="bf16"):
        check_profile_matches(loaded, model, torch.bfloat16)
    problems = check_profile_matches(loaded, other, "bf16", force=True)
    assert len(problems) == 2


def test_fingerprint_ignores_weights_but_not_shapes():
    a = tiny_model(seed=0)
    b = tiny_model(seed=1)
    c = tiny_model(vocab_size=72)
    assert profiling.model_fingerprint(a) == profiling.model_fingerprint(b)
    assert profiling.model_fingerprint(a) != profiling.model_fingerprint(c)


def test_plot_writes_png(tmp_path, hybrid_profile):
    path = profiling.plot_profile(hybrid_profile[1], tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_settings_validation():
    for bad in (dict(sizes=()), dict(sizes=(0, 2, 4)), dict(methods=("stree", "fast")), dict(repeats=0),
                dict(batch=0), dict(warmup=-1), dict(configs=((2, 0),))):
        with pytest.raises(InputError):
            ProfileSettings(**bad).validate()
    assert profiling.parse_sizes("8, 1,2,2") == (1, 2, 8)
    assert profiling.parse_configs("3,2,1;4,2,1,1") == ((3, 2, 1), (4, 2, 1, 1))
    for text in ("1,x", "0,1", ""):
        with pytest.raises(InputError, match="--sizes"):
            profiling.parse_sizes(text)
    with pytest.raises(InputError, match="--methods"):
        profiling.parse_methods("stree,turbo")
    with pytest.raises(InputError, match="--configs"):
        profiling.parse_configs("3,a")


def test_sizes_need_as_many_distinct_sizes_as_a_cost_model_has_coefficients():
    # One size gave "perfect" fits (R^2 1.0 through a single point) that tune-tree then trusted.
    assert profiling.MIN_FIT_SIZES == 3  # t = aN^2 + bN + c
    for sizes in ((4,), (1, 2), (2, 2, 4), ()):
        with pytest.raises(InputError, match="at least 3 different sizes"):
            ProfileSettings(sizes=sizes).validate()
    ProfileSettings(sizes=(2, 4, 8)).validate()


def test_parse_sizes_refuses_empty_items_like_the_other_list_options():
    for text in ("1,,2", "1,2,4,", ",1,2,4", "1, ,2"):
        with pytest.raises(InputError, match="--sizes .* has an empty item"):
            profiling.parse_sizes(text)
    for text, item in (("1,2,x", "'x'"), ("1,2,1.5", "'1.5'"), ("-1,2,4", "'-1'"), ("0,2,4", "'0'")):
        with pytest.raises(InputError, match=f"--sizes .* has {item}"):
            profiling.parse_sizes(text)
    with pytest.raises(InputError, match="--configs .* has an empty item"):
        profiling.parse_configs("3,,1")
    for text in ("3,2;;1", "3,2;", ";3,2"):
        with pytest.raises(InputError, match="--configs .* has an empty configuration"):
            profiling.parse_configs(text)
    assert profiling.parse_sizes(" 4, 1,2 ") == (1, 2, 4)


def test_run_profile_without_the_ar_step_warns_before_timing(caplog):
    logged_before_timing = []

    def progress(*_):
        if not logged_before_timing:
            logged_before_timing.extend(r.getMessage() for r in caplog.records if r.name == "ssmspec.profiling")

    s = ProfileSettings(sizes=(2, 4, 8), methods=("chain",), repeats=1, warmup=0, prompt_len=4, configs=())
    with caplog.at_level("WARNING", logger="ssmspec.profiling"):
        prof = run_profile(tiny_model(layers=("mamba",)), settings=s, progress=progress)
    (w,) = logged_before_timing
    assert "--sizes has no 1" in w and "no AR step" in w and w in prof["warnings"]
    assert all(r["ratio_vs_ar"] is None for r in prof["break_even"]["table"]["chain"])
    assert ProfileSettings(sizes=(2, 4, 8)).warnings(with_drafter=True) != [w]  # the drafter times the AR step
    assert ProfileSettings(sizes=(1, 2, 4)).warnings(with_drafter=False) == []


# -- CLI -----------------------------------------------------------------------------------------
def _invoke(args):
    from typer.testing import CliRunner

    from ssmspec.cli.app import app

    return CliRunner().invoke(app, ["profile", *args])


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    from ssmspec.models.loading import save_model

    root = tmp_path_factory.mktemp("models")
    save_model(tiny_model(layers=("mamba", "mamba")), root / "target")
    save_model(tiny_model(layers=("mamba",), seed=3), root / "drafter")
    return root


def test_cli_end_to_end_on_a_saved_tiny_model(tmp_path, saved_models):
    out = tmp_path / "prof" / "profile.json"
    r = _invoke(["--target", str(saved_models / "target"), "--drafter", str(saved_models / "drafter"),
                 "--sizes", "1,2,4,8", "--repeats", "2", "--warmup", "0", "--prompt-len", "8",
                 "--configs", "2,1;3,1", "--device", "cpu", "--out", str(out.parent)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "CPU" in r.output and "fp32" in r.output and "lambda_gamma" in r.output
    prof = load_profile(out)
    assert prof.data["target"]["architecture"] == "ssm"
    assert prof.data["fits"]["stree"]["primary"] == "linear"
    assert prof.data["settings"]["sizes"] == [1, 2, 4, 8]
    assert prof.data["target"]["source"] == str(saved_models / "target")
    png = out.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    from ssmspec.models.loading import load_model

    assert check_profile_matches(prof, load_model(saved_models / "target").model, "fp32") == []


def test_cli_profiles_a_new_model_tiny_hybrid(tmp_path):
    # The pipeline of the issue: `ssmspec new-model` writes a model, `ssmspec profile` reads it.
    from typer.testing import CliRunner

    from ssmspec.cli.app import app

    runner = CliRunner()
    r = runner.invoke(app, ["new-model", "--preset", "tiny-hybrid", "--out", str(tmp_path / "hyb")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    out = tmp_path / "p" / "profile.json"
    r = runner.invoke(app, ["profile", "--target", str(tmp_path / "hyb"), "--sizes", "1,2,3,4", "--methods", "stree,chain",
                            "--repeats", "2", "--warmup", "0", "--prompt-len", "4", "--device", "cpu",
                            "--out", str(out.parent)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    prof = load_profile(out).data
    assert prof["target"]["architecture"] == "hybrid" and prof["fits"]["chain"]["primary"] == "quadratic"
    assert set(prof["timings"]) == {"stree", "chain"} and prof["drafter_timings"] is None
    assert prof["fits"]["stree"]["sizes"] == [2, 3, 4]
    assert (out.parent / "profile.png").stat().st_size > 10_000


def test_cli_header_names_the_thread_count_timing_runs_on(tmp_path, saved_models):
    # Timing runs on default_cpu_threads() (1 unless OMP_NUM_THREADS is set) whatever torch's count is
    # outside it; the header said torch's count ("CPU (2 threads)") while profile.json said "1 threads".
    timing = default_cpu_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(timing + 1)
    try:
        r = _invoke(["--target", str(saved_models / "target"), "--sizes", "1,2,4", "--methods", "chain",
                     "--repeats", "1", "--warmup", "0", "--prompt-len", "4", "--device", "cpu",
                     "--out", str(tmp_path / "p"), "--no-plot"])
    finally:
        torch.set_num_threads(before)
    assert r.exit_code == 0, r.output + repr(r.exception)
    name = load_profile(tmp_path / "p" / "profile.json").data["device"]["name"]
    assert name.endswith(f", {timing} thread)" if timing == 1 else f", {timing} threads)")
    header = " ".join(r.output.split()).split("ssmspec profile:")[1].split(", fp32")[0]
    assert header.endswith(f"on {name}")


def test_cli_drafter_preset_takes_the_targets_vocabulary_exactly(tmp_path):
    # A preset pads a vocabulary it is given to a multiple of 16 (drafter-2l: 301 -> 304); a drafter
    # built for a target must not, or run_profile refuses the pair after loading both.
    from ssmspec.models.loading import save_model
    from ssmspec.models.presets import build_model
    from test_loading import make_tokenizer

    save_model(build_model("tiny-hybrid", vocab_size=301), tmp_path / "target", tokenizer=make_tokenizer(300))
    r = _invoke(["--target", str(tmp_path / "target"), "--drafter-preset", "drafter-2l", "--sizes", "1,2,4",
                 "--methods", "stree", "--repeats", "1", "--warmup", "0", "--prompt-len", "4", "--configs", "2,1",
                 "--device", "cpu", "--out", str(tmp_path / "p"), "--no-plot"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    prof = load_profile(tmp_path / "p" / "profile.json").data
    assert prof["target"]["config"]["vocab_size"] == prof["drafter"]["config"]["vocab_size"] == 301


@pytest.mark.parametrize("args, message", [
    (["--sizes", "0,2"], "--sizes"),
    (["--sizes", "two"], "--sizes"),
    (["--sizes", "1,,2,4"], "empty item"),
    (["--sizes", "4"], "at least 3 different sizes"),
    (["--methods", "stree,warp"], "--methods"),
    (["--dtype", "int4"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--configs", "3;x"], "--configs"),
])
def test_cli_rejects_bad_input(tmp_path, saved_models, args, message):
    r = _invoke(["--target", str(saved_models / "target"), "--out", str(tmp_path / "p"), "--no-plot", *args])
    if r.exit_code == 2 and r.exception is None or isinstance(r.exception, SystemExit):  # refused while parsing
        assert message in r.output
    else:
        assert isinstance(r.exception, InputError), r.output
        assert message in str(r.exception)
    assert not (tmp_path / "p").exists()


def test_cli_needs_exactly_one_target(tmp_path, saved_models):
    r = _invoke(["--out", str(tmp_path / "p")])
    assert isinstance(r.exception, InputError) and "--target" in str(r.exception)
    r = _invoke(["--target", str(saved_models / "target"), "--target-preset", "tiny"])
    assert isinstance(r.exception, InputError) and "not both" in str(r.exception)


def test_cli_defaults_equal_the_settings_dataclass():
    from ssmspec.cli.profile import profile_command

    defaults = {name: p.default.default for name, p in inspect.signature(profile_command).parameters.items()}
    d = ProfileSettings()
    assert profiling.parse_sizes(defaults["sizes"]) == d.sizes
    assert profiling.parse_methods(defaults["methods"]) == d.methods
    for name in ("batch", "repeats", "warmup", "prompt_len", "fanout", "reference_n", "cuda_graphs", "seed"):
        assert defaults[name] == getattr(d, name), name


def test_profiling_modules_import_no_private_names():
    from tests.test_loading import private_imports

    assert private_imports("ssmspec.profiling") == []


def test_by_width_interpolates_through_the_measured_points():
    from ssmspec.profiling.fits import by_width

    widths, ms = [1, 2, 4], [0.06, 0.05, 0.08]  # a noisy dip at width 2 is kept, not clamped
    assert [by_width(widths, ms, w) for w in widths] == ms
    assert by_width(widths, ms, 3) == pytest.approx(0.065)
    assert by_width(widths, ms, 8) == pytest.approx(0.08 + 4 * 0.015)  # along the last segment
    assert by_width([1, 2, 4], [0.06, 0.09, 0.08], 8) == pytest.approx(0.08)  # never below the last point
    assert by_width(widths, ms, 0.5) == 0.06 and by_width([2], [0.1], 4) == pytest.approx(0.2)
    with pytest.raises(InputError):
        by_width([], [], 1)


@pytest.mark.requires_cuda
def test_run_profile_on_cuda_captures_the_fused_draft_and_times_the_loop():
    from ssmspec.tuning.static import CostModel

    target = tiny_model(layers=("mamba", "mamba")).cuda()
    drafter = tiny_model(layers=("mamba",), seed=1).cuda()
    s = ProfileSettings(sizes=(1, 2, 4, 8), methods=("stree",), repeats=5, warmup=2, prompt_len=16, configs=((2, 1),))
    prof = run_profile(target, settings=s, drafter=drafter)
    d = prof["drafter_timings"]
    assert d["root"]["mode"] == "cuda_graph" and all(r["mode"] == "cuda_graph" for r in d["levels"])
    assert d["configs"][0]["draft"]["mode"] == "cuda_graph"
    it = d["iteration"]
    assert it["loop"]["median"] > 0 and it["bare"]["median"] > 0 and d["iteration_overhead_ms"] >= 0
    cost = CostModel.from_profile(profiling.Profile(prof))
    assert cost.step_ms(Tree.from_config((2, 1))) == pytest.approx(d["configs"][0]["predicted_step_ms"])
