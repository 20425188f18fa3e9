"""Output directories: no command writes where it reads, and `--overwrite` deletes only the command's own output.

A command marks each directory it writes with MARKER (a small JSON file naming the command). An
`--out` that is, contains or lies inside one of the command's inputs is refused; a non-empty `--out`
is replaced only with `--overwrite` and only when its marker names the same command.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping, Optional

from ssmspec.errors import InputError

MARKER = ".ssmspec-output"


def _is_main_process() -> bool:
    # Under torchrun / accelerate every process runs the command; only the first one touches --out.
    from ssmspec.ops.settings import environment

    return environment().rank == 0


def owner_of(out: Path) -> Optional[str]:
    """The command that wrote `out` (from its marker), or None when no ssmspec command marked it."""
    try:
        return str(json.loads((out / MARKER).read_text())["command"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_not_an_input(out: Path, inputs: Mapping[str, Optional[Path]]) -> None:
    """Refuse an --out that is, contains or lies inside one of the command's inputs (flag -> path)."""
    here = out.expanduser().resolve()
    for flag, path in inputs.items():
        if path is None or not Path(path).expanduser().exists():
            continue  # a missing input is reported by whatever loads it
        there = Path(path).expanduser().resolve()
        if here == there:
            relation = "is"
        elif there in here.parents:
            relation = "lies inside"
        elif here in there.parents:
            relation = "contains"
        else:
            continue
        raise InputError(f"--out {out} {relation} the {flag} directory {path}, which this command reads; "
                         f"choose an --out outside it")


def claim(out: Path, command: str, *, inputs: Mapping[str, Optional[Path]], overwrite: bool,
          resume: Optional[bool] = None) -> None:
    """Check `out` before `command` writes there; with --overwrite, delete the command's own earlier output.

    Args:
        out: the --out directory (it need not exist).
        command: the command's name, as written in the marker.
        inputs: flag -> path of everything the command reads (None for flags not given).
        overwrite: --overwrite was given.
        resume: --resume was given (None: the command has no --resume).
    """
    check_not_an_input(out, inputs)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory")
    # A file where a parent directory must go fails only when the output is written, after the
    # whole run: refuse it now.
    parent = next((p for p in out.expanduser().absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InputError(f"--out {out} cannot be made: {parent} is a file, not a directory")
    if not _is_main_process():
        return
    empty = not out.exists() or not any(out.iterdir())
    if empty:
        if resume:
            raise InputError(f"--resume: {out} holds no run to resume; drop --resume to start a new one")
        return
    owner = owner_of(out)
    if owner is None:
        raise InputError(f"--out {out} holds files that no ssmspec command wrote (no {MARKER} file); "
                         f"choose a new or empty --out")
    if owner != command:
        raise InputError(f"--out {out} holds the output of `ssmspec {owner}`; choose another --out")
    if resume:
        return
    if not overwrite:
        again = "pass --resume to continue it, --overwrite to replace it" if resume is not None else "pass --overwrite to replace it"
        raise InputError(f"--out {out} holds an earlier `ssmspec {command}` output; {again}, or choose a new --out")
    shutil.rmtree(out)


def mark(out: Path, command: str) -> None:
    """Write the marker naming `command` into `out` (when `out` exists), so a later --overwrite may replace it."""
    if out.is_dir() and _is_main_process():
        (out / MARKER).write_text(json.dumps({"command": command}) + "\n")
