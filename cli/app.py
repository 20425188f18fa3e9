"""The `ssmspec` Typer app: registers one module per command and turns errors into one-line messages."""
from __future__ import annotations

import os
import sys

import typer

from ssmspec.errors import SsmspecError
from ssmspec.trees import TreeSpecError

app = typer.Typer(
    name="ssmspec",
    help="Speculative decoding for Mamba-2 and hybrid state-space language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Each command lives in its own module and adds itself to `app` on import.
    from . import generate, new_model  # noqa: F401
    from . import bench, tune_tree  # noqa: F401
    for optional in ("profile", "train"):
        try:
            __import__(f"{__package__}.{optional}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{optional}":
                raise


def main() -> None:
    _register()
    try:
        app(standalone_mode=False)
    except (SsmspecError, TreeSpecError) as e:
        if os.environ.get("SSMSPEC_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # click usage errors and the like come through here too
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            print("aborted", file=sys.stderr)
            sys.exit(1)
        raise
