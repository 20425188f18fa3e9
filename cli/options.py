"""Option types shared by the commands, so each flag reads and validates the same way.

Values are checked while the command line is parsed, before any model is loaded: a bad value is a
usage error naming the flag (exit 2). Numbers go through `count` (integers with bounds) or `real`
(finite floats with bounds); names with a fixed set of values through `choice`.
"""
from __future__ import annotations

import math
import re
from typing import Optional

import typer

# Longest generation one command may ask for; the model's context is checked later, against the prompt.
MAX_NEW_TOKENS = 1_000_000
DTYPES = ("fp32", "bf16", "fp16")
BACKENDS = ("auto", "reference", "triton")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def count(default, *names: str, help: str, min: int = 0, max: Optional[int] = None, **kw):
    """An integer option within [min, max]."""
    return typer.Option(default, *names, help=help, min=min, max=max, **kw)


def real(default, *names: str, help: str, min: float = 0.0, max: Optional[float] = None,
         above: bool = False, below: bool = False, **kw):
    """A finite float option within [min, max] (`above` / `below` make that end open)."""
    lo = f"{'>' if above else '>='} {min:g}"
    hi = "" if max is None else f" and {'<' if below else '<='} {max:g}"

    def check(value):
        if value is None:
            return value
        ok = math.isfinite(value) and (value > min if above else value >= min)
        if max is not None:
            ok = ok and (value < max if below else value <= max)
        if not ok:
            raise typer.BadParameter(f"{value!r} is not a finite number {lo}{hi}")
        return value

    return typer.Option(default, *names, help=help, callback=check, **kw)


def one_of(choices: tuple[str, ...]):
    """Callback accepting only `choices` (or None, for an option not given)."""
    def check(value):
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


def choice(default, *names: str, choices: tuple[str, ...], help: str, **kw):
    """A string option taking one of `choices` (listed in the help)."""
    listed = "|".join(choices)
    kw.setdefault("metavar", listed if len(listed) <= 24 else "NAME")
    return typer.Option(default, *names, help=f"{help} One of: {', '.join(choices)}.", callback=one_of(choices), **kw)


def flag(default, *names: str, help: str, **kw):
    """A plain on/off flag (`--json`, or a pair such as `--lora/--no-lora`), never `--json true`."""
    return typer.Option(default, *names, help=help, metavar="", **kw)


def _device(value):
    if value is not None and not _DEVICE.match(value):
        raise typer.BadParameter(f"{value!r} is not a device; use cpu, cuda, cuda:N or auto")
    return value


def non_empty(value):
    """Callback refusing empty strings (alone or in a repeated option)."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and not v.strip():
            raise typer.BadParameter("must not be empty")
    return value


DEVICE = typer.Option("auto", "--device", help="cpu, cuda, cuda:N, or auto (CUDA when available).", callback=_device)
BACKEND = choice("auto", "--backend", choices=BACKENDS,
                 help="Kernels: auto (Triton on CUDA, and on Hopper the one-launch CUDA kernels where the model fits; "
                      "SSMSPEC_STREAM_LAYERS=0 keeps Triton only), reference (plain torch) or triton.")
DTYPE = choice(None, "--dtype", choices=DTYPES, help="Parameter dtype (default: the checkpoint's).")
SEED = count(None, "--seed", help="Random seed for sampling (default 0).")


def deprecated(*names: str, use: str, **kw):
    """A hidden old name of a flag, kept so existing scripts run; the command merges it with `use`."""
    return typer.Option(None, *names, hidden=True, help=f"Deprecated: use {use}.", **kw)


def merge_alias(new, old, default, new_name: str, old_name: str):
    """The value of a flag given under its new or its deprecated name (not both)."""
    from ssmspec.errors import InputError

    if old is None:
        return new
    if new != default:
        raise InputError(f"give {new_name} only ({old_name} is its old name)")
    return old


def model_dir(default, *names: str, help: str, **kw):
    """A model directory the command reads: it must exist (checked while parsing)."""
    return typer.Option(default, *names, exists=True, file_okay=False, help=help, **kw)


def input_file(default, *names: str, help: str, **kw):
    """A file the command reads: it must exist (checked while parsing)."""
    return typer.Option(default, *names, exists=True, dir_okay=False, help=help, **kw)


def drafter_or_ngram(value):
    """Callback for --drafter: an existing model directory, or 'ngram' for prompt lookup."""
    from pathlib import Path

    non_empty(value)
    if value is not None and value != "ngram" and not Path(value).expanduser().is_dir():
        raise typer.BadParameter(f"{value} is not a model directory; pass one, or 'ngram' for prompt lookup")
    return value


def tree_specs(value):
    """Callback for --tree (one value or a repeated option): each must parse as a tree spec."""
    from ssmspec.trees import TreeSpecError, parse_tree_spec

    for spec in value if isinstance(value, (list, tuple)) else [value]:
        if spec is None:
            continue
        try:
            parse_tree_spec(spec)
        except (TreeSpecError, ValueError, OSError) as e:
            raise typer.BadParameter(" ".join(str(e).split())) from None
    return value


def comma_choices(choices: tuple[str, ...], what: str):
    """Callback for a comma-separated list of names from `choices` (e.g. --methods ar,chain)."""
    def check(value):
        if value is None:
            return value
        names = [v.strip() for v in value.split(",")]
        if not any(names) or not all(names):
            raise typer.BadParameter(f"{value!r} names an empty {what}; give a comma-separated list of {', '.join(choices)}")
        for name in names:
            if name not in choices:
                raise typer.BadParameter(f"unknown {what} {name!r}; choose from {', '.join(choices)}")
        return value

    return check
