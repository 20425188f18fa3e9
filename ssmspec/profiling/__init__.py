"""Runtime profiling of target and drafter calls against input size, cost-model fits, profile.json.

`measure.run_profile` times the calls (what and how: its docstring), `timing` is the harness
(`time_call`, for benchmarks too), `fits` the cost models and break-even ratios, `schema` profile.json
(its fields, reading, writing, matching a model), `plot` the PNG, `settings` the defaults.
"""
from __future__ import annotations

from .fits import (
    MIN_FIT_SIZES, Fit, break_even_ratio, compute_break_even, compute_fits, fit_cost_model, fit_warnings,
    fitted_sizes, primary_fit_kind, r_squared,
)
from .measure import balanced_tree, count_items, device_name, run_profile, timing_threads, timing_warnings
from .plot import plot_profile
from .schema import (
    SCHEMA_NAME, SCHEMA_VERSION, Profile, architecture_of, check_profile_matches, config_summary, dtype_name,
    load_profile, model_fingerprint, save_profile, validate_profile,
)
from .settings import (
    DEFAULT_CONFIGS, DTYPES, METHODS, ProfileSettings, ProgressFn, parse_configs, parse_methods, parse_sizes,
)
from .timing import Timing, cpu_threads, default_cpu_threads, samples_disagree, time_call

__all__ = [
    "DEFAULT_CONFIGS", "DTYPES", "METHODS", "MIN_FIT_SIZES", "SCHEMA_NAME", "SCHEMA_VERSION", "Fit", "Profile",
    "ProfileSettings", "ProgressFn", "Timing", "architecture_of", "balanced_tree", "break_even_ratio",
    "check_profile_matches", "compute_break_even", "compute_fits", "config_summary", "count_items", "cpu_threads",
    "default_cpu_threads", "device_name", "dtype_name", "fit_cost_model", "fit_warnings", "fitted_sizes",
    "load_profile", "model_fingerprint", "parse_configs", "parse_methods", "parse_sizes", "plot_profile",
    "primary_fit_kind", "r_squared", "run_profile", "samples_disagree", "save_profile", "time_call",
    "timing_threads", "timing_warnings", "validate_profile",
]
