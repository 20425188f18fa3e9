"""tree.json as written by `ssmspec tune-tree`: the chosen tree or bandit arm set, with its evidence.

Schema "ssmspec.tree", version 1::

    {"schema": "ssmspec.tree", "version": 1, "created": ISO-8601 UTC,
     "mode": "static" | "bandit" | "both",
     "tree": {"version": 1, "config": [int] | absent, "parents": [int]}      -- a static choice, or
     "bandit": {"arms": [tree...], "lambda_ucb", "lambda_gamma", "state"},  -- an arm set (exactly one)
     "target": {"fingerprint", "source"}, "drafter": {"fingerprint", "source"},
     "profile": {"path", "device", "dtype"},
     "settings": {resolved TuneSettings},
     "statistics": [AcceptanceStats.to_json() per temperature],
     "predictions": [Prediction.to_json(), best predicted first],
     "measured": [{"tree", "predicted_tokens_per_s", "measured_tokens_per_s", "predicted_tokens",
                   "measured_tokens", "predicted_step_ms", "predicted_parts_ms": {"target", "draft",
                   "overhead"}, "measured_step_ms", ...}],
     "bandit_run": null | {"spec", "rounds", "pulls", "mean_reward", "mean_tokens", "best",
                           "history": [[round, arm, tokens, reward]], "measured_tokens_per_s",
                           "overhead_fraction": choose + observe time over a step's time}}

`generate --tree tree.json` reads only "tree" or "bandit" (ssmspec.trees.load_tree_file).
"""
from __future__ import annotations

import json
from pathlib import Path

from ssmspec.errors import InputError
from ssmspec.trees import TREE_FILE_SCHEMA, Tree, TreeArms, TreeSpecError
from ssmspec.trees.tree import TREE_FILE_VERSION, read_json_file

MODES = ("static", "bandit", "both")
_REQUIRED = ("schema", "version", "created", "mode", "target", "drafter", "profile", "settings", "statistics",
             "predictions", "measured", "bandit_run")


def validate_tree_file(d: dict, where: str = "tree.json") -> Tree | TreeArms:
    """Raise InputError (one line) unless `d` follows the schema; returns its tree or arm set."""
    if not isinstance(d, dict):
        raise InputError(f"{where} must hold a JSON object")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise InputError(f"{where} lacks {', '.join(missing)}; write it with `ssmspec tune-tree`")
    if d["schema"] != TREE_FILE_SCHEMA:
        raise InputError(f"{where} has schema {d['schema']!r}, not {TREE_FILE_SCHEMA!r}")
    if d["version"] != TREE_FILE_VERSION:
        raise InputError(f"{where} version {d['version']} is not supported (this ssmspec reads {TREE_FILE_VERSION})")
    if d["mode"] not in MODES:
        raise InputError(f"{where} mode {d['mode']!r} is not one of {', '.join(MODES)}")
    if ("tree" in d) == ("bandit" in d):
        raise InputError(f"{where} must hold exactly one of 'tree' and 'bandit'")
    for key in ("statistics", "predictions", "measured"):
        if not isinstance(d[key], list):
            raise InputError(f"{where}: '{key}' must be a list")
    for s in d["statistics"]:
        if not isinstance(s, dict) or not {"temperature", "acceptance", "reached", "accepted"} <= set(s):
            raise InputError(f"{where}: each statistics entry needs temperature, acceptance, reached and accepted")
    try:
        return TreeArms.from_json(d["bandit"]) if "bandit" in d else Tree.from_json(d["tree"])
    except TreeSpecError as e:
        raise InputError(f"{where}: {e}") from None


def write_tree_file(d: dict, path: str | Path) -> Path:
    validate_tree_file(d, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1) + "\n")
    return path


def read_tree_file(path: str | Path) -> dict:
    """Read and validate a tune-tree tree.json (all of it, statistics included)."""
    d = read_json_file(path, "tree file", InputError)
    validate_tree_file(d, str(path))
    return d
