"""The `ssmspec` Typer app: the list of commands, and the one boundary every command's errors pass through."""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Optional

import typer

from ssmspec.errors import SsmspecError
from ssmspec.trees import TreeSpecError

from . import bench, generate, new_model, prepare, profile, train, tune_tree

app = typer.Typer(
    name="ssmspec",
    help="Speculative decoding for Mamba-2 and hybrid state-space language models.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Every command, by name; a new command is one more line here (its module holds one function).
COMMANDS = [
    ("new-model", new_model.new_model_command),
    ("distill", train.distill_command),
    ("sft", train.sft_command),
    ("profile", profile.profile_command),
    ("generate", generate.generate_command),
    ("tune-tree", tune_tree.tune_tree_command),
    ("bench", bench.bench_command),
    ("prepare", prepare.prepare_command),
]
for _name, _function in COMMANDS:
    app.command(_name)(_function)

# Exit statuses: 2 for a usage error or bad input, 1 for a failure, 130 for an interrupt.
USAGE, FAILURE, INTERRUPTED = 2, 1, 130


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"ssmspec {version('ssmspec')}")
        except PackageNotFoundError:
            typer.echo("ssmspec (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_version, metavar="",
                                      help="Print the version and exit."),
) -> None:
    """Speculative decoding for Mamba-2 and hybrid state-space language models."""


def _click_classes(name: str) -> tuple[type, ...]:
    """Exception class `name` from every copy of click in use: typer's bundled `typer._click` (typer >= 0.27) and click."""
    found = []
    for module in ("typer._click.exceptions", "typer.exceptions", "click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


_CLICK_EXCEPTION, _USAGE_ERROR = _click_classes("ClickException"), _click_classes("UsageError")
_EXIT, _ABORT = _click_classes("Exit"), _click_classes("Abort")
_NO_ARGS = _click_classes("NoArgsIsHelpError")


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# What to change when a command runs out of memory: its own options.
_TRAINING_OOM = ("--recompute (activations recomputed in the backward pass), a smaller --batch-size with a "
                 "larger --grad-accum (the same tokens per step) or a shorter --seq-len")
_OOM_HINTS = {
    "sft": _TRAINING_OOM,
    "distill": _TRAINING_OOM,
    "profile": "smaller --sizes, a shorter --prompt-len, --dtype bf16 or --device cpu",
    "tune-tree": "a smaller --budget, fewer --max-new-tokens, --dtype bf16 or --device cpu",
}
_DECODE_OOM = "a shorter prompt, fewer --max-new-tokens, a smaller tree, --dtype bf16 or --device cpu"


def _command(args: Optional[list[str]]) -> Optional[str]:
    """The command named on a command line (its first word that is not an option), or None."""
    words = sys.argv[1:] if args is None else [str(a) for a in args]
    return next((w for w in words if not w.startswith("-")), None)


def explain(e: BaseException, command: Optional[str] = None) -> tuple[int, Optional[str]]:
    """(exit status, one-line message or None) for an exception that reached the boundary while
    `command` ran (its name picks the out-of-memory hint)."""
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    if isinstance(e, SystemExit):
        return (e.code if isinstance(e.code, int) else (0 if e.code is None else FAILURE)), None
    if isinstance(e, _EXIT):
        return int(getattr(e, "exit_code", 0) or 0), None
    if isinstance(e, _ABORT):
        return FAILURE, "aborted"
    if isinstance(e, _NO_ARGS):
        if e.format_message().strip():  # rich help was printed already, when the error was made
            typer.echo(e.format_message())
        return USAGE, "no command given; choose one of the commands above"
    if isinstance(e, _USAGE_ERROR):
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        return USAGE, _one_line(e.format_message()) + hint
    if isinstance(e, _CLICK_EXCEPTION):
        return int(getattr(e, "exit_code", FAILURE)), _one_line(e.format_message())
    if isinstance(e, (SsmspecError, TreeSpecError)):
        return USAGE, _one_line(str(e))
    if isinstance(e, UnicodeDecodeError):
        return USAGE, f"input is not UTF-8 text ({_one_line(str(e), 160)}); convert it first, e.g. with iconv"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, torch.cuda.OutOfMemoryError):
        return FAILURE, f"out of GPU memory ({_one_line(str(e), 160)}); try {_OOM_HINTS.get(command, _DECODE_OOM)}"
    if isinstance(e, MemoryError):
        return FAILURE, f"out of memory; try {_OOM_HINTS.get(command, _DECODE_OOM)}"
    if isinstance(e, BrokenPipeError):
        return FAILURE, None  # the reader went away (`ssmspec generate ... | head`): nothing left to tell
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)):
        return USAGE, _one_line(str(e))
    if isinstance(e, OSError):
        return FAILURE, _one_line(str(e))
    if isinstance(e, ValueError):
        return USAGE, _one_line(str(e))
    if isinstance(e, RuntimeError):
        return FAILURE, _one_line(str(e))
    return FAILURE, f"unexpected {type(e).__name__}: {_one_line(str(e), 300)} (SSMSPEC_DEBUG=1 shows the traceback)"


def run(args: Optional[list[str]] = None) -> int:
    """Run the command line `args` (default: sys.argv[1:]); return the exit status. Errors print one line on stderr."""
    try:
        status = app(args=args, prog_name="ssmspec", standalone_mode=False)
        # typer hands back the status of an Exit (130 for a Ctrl-C it caught) instead of raising it.
        return status if isinstance(status, int) else 0
    except BaseException as e:  # noqa: BLE001 -- this is the boundary: everything ends here
        status, message = explain(e, _command(args))
        if os.environ.get("SSMSPEC_DEBUG") and not isinstance(e, (SystemExit, *_EXIT)):
            traceback.print_exc()
        if isinstance(e, BrokenPipeError):
            _silence_stdout()
        if message:
            print(f"error: {message}" if status != INTERRUPTED else message, file=sys.stderr)
        return status


def _silence_stdout() -> None:
    # Python flushes stdout at exit; with the pipe gone that would print a second error.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main() -> None:
    """The `ssmspec` console entry point."""
    sys.exit(run())
