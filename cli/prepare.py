"""`ssmspec prepare`: build and compile ahead of time what decoding a model will need on this machine."""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from ssmspec.errors import InputError

from . import options


def _cache_dirs() -> list[str]:
    """Where the compiled work is kept between processes, as Triton and torch resolve it."""
    from torch.utils.cpp_extension import get_default_build_root

    try:
        from triton import knobs  # triton >= 3.4

        triton_dir = knobs.cache.dir
    except ImportError:
        from triton.runtime.cache import default_cache_dir

        triton_dir = default_cache_dir()
    return [f"Triton kernels: {triton_dir}", f"CUDA extensions: {get_default_build_root()}"]


def prepare_command(
    target: Path = typer.Option(..., "--target", exists=True, file_okay=False, help="Target model directory."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter model directory, or 'ngram' for prompt lookup.",
                                          callback=options.non_empty),
    tree: Optional[List[str]] = typer.Option(None, "--tree", help="A tree the drafter will draft (repeatable): "
                                             "3,2,1, 'parents:-1,0,0', bandit:..., or a tree.json. Default: 3,2,1 with a drafter."),
    temperature: float = options.real(0.0, "--temperature", help="Also prepare sampling at this temperature (0: greedy only)."),
    dtype: Optional[str] = options.DTYPE,
    device: str = options.DEVICE,
    backend: str = options.BACKEND,
) -> None:
    """Build and compile, ahead of time, what decoding this model needs on this machine.

    On a GPU the first decoding of a model shape compiles its Triton kernels and builds the one-launch CUDA extensions (about a minute on a fresh machine); both are kept on disk, so a later process starts in seconds. This runs one short generation per method and tree (and at --temperature, if given) and reports the time each took and where the results are kept.

    On the CPU there is nothing to build: the reference path runs plain torch.

    Examples:
        ssmspec prepare --target runs/target --drafter runs/drafter --tree 3,2,1 --tree 1,1,1,1,1
        ssmspec prepare --target runs/target            # autoregressive decoding only
    """
    from ssmspec.api import load_drafter, load_target
    from ssmspec.ops import dispatch
    from ssmspec.trees import parse_tree_spec

    dispatch.set_backend(backend)
    if drafter not in (None, "ngram") and not Path(drafter).is_dir():
        raise InputError(f"--drafter {drafter} is not a model directory; pass one, or 'ngram' for prompt lookup")
    if tree and drafter is None:
        raise InputError("--tree needs --drafter (a model directory or 'ngram'): without one only ar is prepared")
    shapes = [parse_tree_spec(t) for t in (tree or [])]
    loaded = load_target(target, dtype=dtype, device=device)
    model = loaded.model
    if model.device.type != "cuda":
        typer.echo(f"nothing to build on {model.device}: decoding there runs the plain-torch reference path")
        return
    drafter_obj = load_drafter(drafter, loaded) if drafter is not None else None
    for line in prepare(model, drafter_obj, shapes, temperature):
        typer.echo(line)
    typer.echo("kept for later processes:\n  " + "\n  ".join(_cache_dirs()))


def prepare(model, drafter, shapes: list, temperature: float = 0.0):
    """Run one short generation per method and tree (and at `temperature` when > 0) through an
    Engine, which compiles and captures what later generations of those settings use; yields a
    line per setting with the time it took, then the code paths chosen (ops/paths.py explain)."""
    from ssmspec.decoding import Engine, GenerationConfig
    from ssmspec.ops import paths
    from ssmspec.trees import parse_tree_spec

    if drafter is not None and not shapes:
        shapes = [parse_tree_spec("3,2,1")]
    engine = Engine(model, drafter)
    settings = [("ar", None)] + ([("stree", shape) for shape in shapes] if drafter is not None else [])
    temperatures = [0.0] + ([temperature] if temperature > 0 else [])
    for t in temperatures:
        for method, shape in settings:
            started = time.perf_counter()
            engine.warm_up(GenerationConfig(method=method, tree=shape, temperature=t, seed=0))
            what = "ar" if shape is None else f"stree {shape.spec()}"
            yield f"{what}{'' if t == 0 else f' at T={t:g}'}: ready in {time.perf_counter() - started:.1f} s"
    for line in paths.explain(model):
        yield f"  {line}"
