"""profile.json: its schema (versioned), the model description it records, reading, writing, matching.

profile.json, schema version 2 (all times in milliseconds)
----------------------------------------------------------
::

    {
      "schema": "ssmspec.profile", "version": 2,
      "created": ISO-8601 UTC time,
      "device": {"type": "cuda"|"cpu", "name": str, "torch": str, "cuda": str|null},
      "dtype": "fp32"|"bf16"|"fp16",
      "target": {"fingerprint": hex str (see model_fingerprint), "source": str, "architecture": "ssm"|"hybrid",
                 "config": {"d_model", "vocab_size", "n_layers", "layer_counts": {kind: n},
                            "num_parameters", "mamba": {...}|null, "attention": {...}|null}},
      "drafter": null | same shape as "target",
      "settings": {"sizes": [int], "methods": [str], "batch": int, "prompt_len": int,
                   "warmup": int, "repeats": int, "fanout": int,
                   "cuda_graphs": bool (graphs were asked for and the device is CUDA),
                   "threads": int (torch CPU threads while timing; optional),
                   "reference_n": int, "configs": [[int]],
                   "backend": {"backend": auto|reference|triton, op: "reference"|kernel module}},
      "timings": {method: [{"size": N, "call": "step"|"verify+replay", "rows": int,
                            "tokens": int, "tree": {"nodes", "depth", "leaves"},
                            "mode": "eager"|"cuda_graph", "note": str|null,
                            "median", "min", "max", "q1", "q3", "iqr", "samples": [float]}]},
      "fits": {method: {"primary": "linear"|"quadratic", "sizes": [N fitted],
                        "linear": {"coef": {"k", "C"}, "r2", "residuals": [float]},
                        "quadratic": {"coef": {"a", "b", "c"}, "r2", "residuals": [float]}}},
      "break_even": {"reference_n": N1, "reference_method": str, "reference_ms": float,
                     "table": {method: [{"n": N2, "ratio": t(N2)/t_ref(N1) | null,
                                         "ratio_vs_ar": t(N2)/t_AR | null}]}},
                     (null where a fit predicts a non-positive time)
      "drafter_timings": null | {"impl": str, "target_step_ms": float (the target's AR step),
                                 "root": {...timing} (FusedGreedyDraft.step_root: commit gather + root step),
                                 "levels": [{"width": W, "parent_width": int, "children": int, ...timing}]
                                   (FusedGreedyDraft.draft_level: top-k over the parents' logits, gather
                                    of the parents' states, a drafter step at width W),
                                 "configs": [{"config": [int], "nodes": int, "widths": [W of each level],
                                              "draft": {...timing} (FusedGreedyDraft.run, whole),
                                              "composed_ms": root + levels at widths (the cost model's draft),
                                              "predicted_verify_ms", "predicted_step_ms" (verify + composed
                                              + iteration_overhead_ms), "extrapolated": bool, "lambda_gamma"}],
                                 "iteration": {"tree": [int], "loop": {...timing} | null (a real decode
                                               loop's wall time per iteration), "bare": {...timing} | null
                                               (the same iteration replayed back to back),
                                               "overhead_ms", "predicted_bare_ms": float | null
                                               (stree fit + composed draft of that tree), "note": str (optional)},
                                 "iteration_overhead_ms": loop - bare (>= 0): the host's share of an iteration,
                                 "lambda_gamma": T_level(width 1) / T_target(size 1)},
      "warnings": [str] (timings that disagree, fits that explain little; optional),
      "elapsed_s": seconds the whole measurement took (optional)
    }

Fits use the verify calls only (sizes >= 2, when there are at least three; see `fitted_sizes`):
the size-1 autoregressive step is another code path. Residuals are measured minus fitted
medians, in the order of the fit's sizes. ``lambda_gamma``
is the mamba-drafters paper's bandit weight (its A.4): the drafter's per-level time (one fused
draft level at width 1, as the decode loop runs it) over the target's autoregressive step time.
A decoding step is predicted as target fit(N) + root + levels + iteration_overhead_ms
(tuning/static.py CostModel). Version 1 timed bare drafter steps (``steps``), one fewer per tree
than the fused draft runs, and no loop overhead: its predictions were far too fast, so it is
refused with a request to re-run ``ssmspec profile``. The target fingerprint hashes the architecture (config,
parameter shapes and dtypes; `ssmspec.models.loading.model_fingerprint`), not the weights,
because runtime depends only on the former. Optional fields (threads, warnings, elapsed_s)
were added without a version change: profiles without them still load.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ssmspec.trees.tree import read_json_file

from ..errors import InputError, ProfileMismatchError
from ..models.loading import model_fingerprint
from .fits import Fit
from .settings import DTYPES, METHODS


SCHEMA_NAME = "ssmspec.profile"
SCHEMA_VERSION = 2


def architecture_of(model) -> str:
    """hybrid when the model has attention layers (quadratic cost model), else ssm (linear)."""
    return "hybrid" if "attention" in model.config.layers else "ssm"


def config_summary(model) -> dict:
    """The shape of a model that its runtime depends on, as profile.json records it."""
    cfg = model.config
    kinds = {k: cfg.layers.count(k) for k in ("mamba", "attention", "mlp") if k in cfg.layers}
    summary = {
        "d_model": cfg.d_model, "vocab_size": cfg.vocab_size, "n_layers": len(cfg.layers),
        "layer_counts": kinds, "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "mamba": None, "attention": None,
    }
    if "mamba" in kinds:
        m = cfg.mamba
        summary["mamba"] = {"n_heads": m.n_heads, "head_dim": m.head_dim, "d_state": m.d_state,
                            "n_groups": m.n_groups, "conv_kernel": m.conv_kernel}
    if "attention" in kinds:
        a = cfg.attention
        summary["attention"] = {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim}
    return summary


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise InputError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")


@dataclass
class Profile:
    """A loaded profile.json; `data` is the validated dict, unchanged (so it round-trips)."""

    data: dict = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return self.data["target"]["fingerprint"]

    @property
    def dtype(self) -> str:
        return self.data["dtype"]

    @property
    def device_name(self) -> str:
        return self.data["device"]["name"]

    def fit(self, method: str = "stree", kind: str | None = None) -> Fit:
        """The fitted cost model of `method` (its primary kind unless `kind` is given)."""
        if method not in self.data["fits"]:
            raise InputError(f"profile has no fits for method {method!r}; it has {', '.join(self.data['fits'])}")
        f = self.data["fits"][method]
        kind = kind or f["primary"]
        return Fit.from_dict(kind, f[kind])

    def target_ms(self, n, method: str = "stree"):
        """Predicted time of one target call on n packed tokens, in ms."""
        return self.fit(method)(n)

    @property
    def ar_step_ms(self) -> float | None:
        for rows in self.data["timings"].values():
            for r in rows:
                if r["size"] == 1:
                    return r["median"]
        return None

    @property
    def lambda_gamma(self) -> float | None:
        """T_draft / T_target for the bandit reward, or None without drafter timings."""
        d = self.data.get("drafter_timings")
        return None if d is None else d["lambda_gamma"]

    def to_dict(self) -> dict:
        return self.data


def save_profile(profile: dict | Profile, path: str | Path) -> Path:
    """Validate and write profile.json (parent directories created); returns the path."""
    data = profile.data if isinstance(profile, Profile) else profile
    validate_profile(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _require(d: dict, keys: Sequence[str], where: str) -> None:
    if not isinstance(d, dict):
        raise InputError(f"profile.json: {where} must be an object")
    missing = [k for k in keys if k not in d]
    if missing:
        raise InputError(f"profile.json: {where} lacks {', '.join(missing)}; re-run `ssmspec profile`")


def validate_profile(d: dict) -> None:
    """Raise InputError unless d follows the schema described in this module's docstring."""
    _require(d, ["schema", "version"], "the top level")
    if d["schema"] != SCHEMA_NAME:
        raise InputError(f"not an ssmspec profile (schema {d['schema']!r}); write one with `ssmspec profile`")
    if d["version"] == 1:
        raise InputError(
            "profile.json has schema version 1, which timed bare drafter steps instead of the fused draft "
            "and loop overhead the decoder pays (its predicted speeds were up to 2x too high); "
            "re-run `ssmspec profile` to write version 2"
        )
    if d["version"] != SCHEMA_VERSION:
        raise InputError(
            f"profile.json schema version {d['version']} is not supported (this ssmspec reads {SCHEMA_VERSION}); "
            "re-run `ssmspec profile`"
        )
    _require(d, ["created", "device", "dtype", "target", "settings", "timings", "fits", "break_even",
                 "drafter_timings"], "the top level")
    _require(d["device"], ["type", "name"], "device")
    if d["dtype"] not in DTYPES:
        raise InputError(f"profile.json: dtype {d['dtype']!r} is not one of {', '.join(DTYPES)}")
    _require(d["target"], ["fingerprint", "architecture", "config"], "target")
    for method, rows in d["timings"].items():
        if method not in METHODS:
            raise InputError(f"profile.json: unknown method {method!r} in timings")
        if not isinstance(rows, list) or not rows:
            raise InputError(f"profile.json: timings of {method} must be a non-empty list")
        for r in rows:
            _require(r, ["size", "median", "samples"], f"a timing of {method}")
            if not (isinstance(r["median"], (int, float)) and math.isfinite(r["median"])):
                raise InputError(f"profile.json: a timing of {method} has a non-numeric median")
    for method, f in d["fits"].items():
        _require(f, ["primary", "linear", "quadratic"], f"fits of {method}")
        if f["primary"] not in ("linear", "quadratic"):
            raise InputError(f"profile.json: fits of {method} name an unknown primary {f['primary']!r}")
        for kind in ("linear", "quadratic"):
            _require(f[kind], ["coef", "r2", "residuals"], f"the {kind} fit of {method}")
    _require(d["break_even"], ["reference_n", "reference_method", "table"], "break_even")
    warnings = d.get("warnings", [])
    if not (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)):
        raise InputError("profile.json: warnings must be a list of sentences")
    if d["drafter_timings"] is not None:
        _require(d["drafter_timings"], ["root", "levels", "configs", "iteration", "iteration_overhead_ms",
                                        "lambda_gamma", "target_step_ms"], "drafter_timings")
        if not d["drafter_timings"]["levels"]:
            raise InputError("profile.json: drafter_timings.levels is empty; re-run `ssmspec profile`")


def load_profile(path: str | Path) -> Profile:
    """Read and validate profile.json; raises InputError with what to do when it is unusable."""
    data = read_json_file(path, "profile file", InputError,
                          "; write one with `ssmspec profile --out DIR` (it writes DIR/profile.json)")
    validate_profile(data)
    return Profile(data)


def check_profile_matches(profile: Profile | dict, model, dtype: torch.dtype | str, force: bool = False) -> list[str]:
    """Refuse a profile measured on another architecture or dtype (ProfileMismatchError).

    With force=True the mismatches are returned as warning sentences instead. Returns [] when
    the profile matches.
    """
    data = profile.data if isinstance(profile, Profile) else profile
    want_dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
    problems = []
    fp = model_fingerprint(model)
    if data["target"]["fingerprint"] != fp:
        src = data["target"].get("source") or "another model"
        problems.append(
            f"the profile was measured on {src} (fingerprint {data['target']['fingerprint'][:12]}), "
            f"not on this target (fingerprint {fp[:12]})"
        )
    if data["dtype"] != want_dtype:
        problems.append(f"the profile was measured in {data['dtype']}, this run uses {want_dtype}")
    if problems and not force:
        raise ProfileMismatchError(
            "; ".join(problems) + ". Run `ssmspec profile` for this model and dtype, or pass --force to use it anyway."
        )
    return problems
