"""`ssmspec profile`: time target (and drafter) calls against input size and fit the cost models.

Example:
    ssmspec profile --target-preset mamba2-2.7b --device cuda --dtype bf16 --out runs/profile
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ssmspec import profiling
from ssmspec.errors import InputError
from ssmspec.models.presets import PRESETS

from . import options, outputs

_D = profiling.ProfileSettings()


def _load(path: Optional[Path], preset: Optional[str], what: str, dtype, device, vocab_size=None, required=True):
    """A LanguageModel from a directory or a preset name, and a string saying which."""
    if path is not None and preset is not None:
        raise InputError(f"give --{what} or --{what}-preset, not both")
    if path is None and preset is None:
        if required:
            raise InputError(f"give the model to profile: --{what} DIR or --{what}-preset NAME (e.g. tiny, mamba2-2.7b)")
        return None, ""
    if path is not None:
        from ssmspec.models.loading import load_model

        return load_model(path, dtype=dtype, device=device).model.eval(), str(path)
    from ssmspec.models.presets import build_model

    # vocab_size is the target's, for a drafter: take it exactly. A preset's padding to a multiple of
    # 16 would make it wider than a target of, say, 301 tokens, and run_profile refuses that.
    model = build_model(preset, vocab_size=vocab_size, pad_vocab=False, dtype=dtype, device=device)
    return model.eval(), f"preset {preset}"


def profile_command(
    target: Optional[Path] = typer.Option(None, "--target", exists=True, file_okay=False, help="Target model directory."),
    target_preset: Optional[str] = options.choice(None, "--target-preset", choices=tuple(PRESETS),
                                                  help="Or a preset with random weights (e.g. mamba2-2.7b)."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", exists=True, file_okay=False,
                                           help="Drafter model directory (times drafting too)."),
    drafter_preset: Optional[str] = options.choice(None, "--drafter-preset", choices=tuple(PRESETS),
                                                   help="Or a drafter preset (e.g. drafter-2l), built with the target's vocabulary."),
    sizes: str = typer.Option(",".join(map(str, _D.sizes)), "--sizes", help="Input sizes N (1 = the autoregressive step)."),
    methods: str = typer.Option(",".join(_D.methods), "--methods", help="Any of stree, unrolled, chain."),
    batch: int = options.count(_D.batch, "--batch", min=1, help="Sequences per call."),
    repeats: int = options.count(_D.repeats, "--repeats", min=1, help="Timed calls per measurement (median reported)."),
    warmup: int = options.count(_D.warmup, "--warmup", help="Untimed calls before each measurement."),
    prompt_len: int = options.count(_D.prompt_len, "--prompt-len", min=1, help="Prompt tokens prefilled into the cache."),
    dtype: str = options.choice("auto", "--dtype", choices=("auto", *profiling.DTYPES),
                                help="Parameter dtype (auto: bf16 on CUDA, fp32 on the CPU)."),
    device: str = options.DEVICE,
    configs: Optional[str] = typer.Option(None, "--configs", help="Tree configurations to time drafting for, e.g. '3,2,1;4,2,1,1'."),
    fanout: int = options.count(_D.fanout, "--fanout", min=1, help="Children per node of the balanced tree timed by stree/unrolled."),
    reference_n: int = options.count(_D.reference_n, "--reference-n", min=1, help="N1 of the break-even ratio t(N2)/t(N1)."),
    cuda_graphs: bool = options.flag(_D.cuda_graphs, "--cuda-graphs/--no-cuda-graphs", help="Replay each call as a CUDA graph when it can be captured."),
    backend: str = options.BACKEND,
    out: Path = typer.Option(Path("profile"), "--out", help="Directory to write profile.json and profile.png into."),
    no_plot: bool = options.flag(False, "--no-plot", help="Do not draw profile.png."),
    overwrite: bool = options.flag(False, "--overwrite", help="Replace an earlier `ssmspec profile` output in --out."),
    seed: int = options.count(_D.seed, "--seed", help="Seed of the random prompt and tokens."),
) -> None:
    """Measure target (and drafter) runtime against input size, fit t = kN + C / aN^2 + bN + c, write profile.json.

    Examples:
        ssmspec profile --target runs/target --drafter runs/drafter --out runs/profile
        ssmspec profile --target-preset mamba2-2.7b --drafter-preset drafter-2l --device cuda --dtype bf16
    """
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ssmspec.api import resolve_device
    from ssmspec.ops import dispatch, paths

    console = Console()
    settings = profiling.ProfileSettings(
        sizes=profiling.parse_sizes(sizes), methods=profiling.parse_methods(methods), batch=batch,
        repeats=repeats, warmup=warmup, prompt_len=prompt_len, fanout=fanout, cuda_graphs=cuda_graphs,
        reference_n=reference_n, configs=profiling.parse_configs(configs) if configs else _D.configs, seed=seed,
    )
    settings.validate()
    outputs.claim(out, "profile", inputs={"--target": target, "--drafter": drafter}, overwrite=overwrite)
    dev = resolve_device(device)
    if dtype == "auto":
        dtype = "bf16" if dev.type == "cuda" else "fp32"
    torch_dtype = profiling.DTYPES[dtype]
    dispatch.set_backend(backend)
    paths.check_device(dev)  # a backend that cannot run there fails now, not after the first timings

    tgt, tgt_src = _load(target, target_preset, "target", torch_dtype, dev)
    drf, drf_src = _load(drafter, drafter_preset, "drafter", torch_dtype, dev,
                         vocab_size=tgt.config.vocab_size, required=False)
    if drf is not None and drafter is not None:
        from ssmspec.models.loading import check_same_vocab

        check_same_vocab(tgt, drf)

    name = profiling.device_name(dev, profiling.timing_threads(settings, dev))
    console.print(f"[bold]ssmspec profile[/]: {tgt_src} ({profiling.architecture_of(tgt)}, "
                  f"{sum(p.numel() for p in tgt.parameters()) / 1e6:.1f}M params) on [bold]{name}[/], {dtype}, "
                  f"batch {batch}, prompt {prompt_len}" + (f"; drafter {drf_src}" if drf is not None else ""))

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("timing", total=profiling.count_items(settings, drf is not None))

        def progress(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        prof = profiling.run_profile(tgt, settings=settings, drafter=drf, source=tgt_src,
                                     drafter_source=drf_src, progress=progress)

    json_path = profiling.save_profile(prof, out / "profile.json")
    outputs.mark(out, "profile")
    render_profile(prof, console)
    console.print(f"wrote {json_path}")
    if not no_plot:
        png = profiling.plot_profile(prof, out / "profile.png")
        console.print(f"wrote {png}")


def render_profile(prof: dict, console) -> None:
    """Rich tables: timings per size and method, both fits, break-even ratios, drafter timings."""
    from rich.table import Table

    methods = list(prof["timings"])
    t = Table(title=f"target call time, ms (median ± IQR/2; g = CUDA graph) on {prof['device']['name']}, {prof['dtype']}")
    t.add_column("N", justify="right")
    for m in methods:
        t.add_column(m, justify="right")
    sizes = sorted({r["size"] for rows in prof["timings"].values() for r in rows})
    for n in sizes:
        cells = []
        for m in methods:
            r = next((r for r in prof["timings"][m] if r["size"] == n), None)
            cells.append("" if r is None else f"{r['median']:.3f} ± {r['iqr'] / 2:.3f}" + (" g" if r["mode"] == "cuda_graph" else ""))
        t.add_row(str(n) + (" (AR step)" if n == 1 else ""), *cells)
    console.print(t)
    notes = {r["note"] for rows in prof["timings"].values() for r in rows if r.get("note")}
    for note in sorted(notes):
        console.print(f"[dim]eager: {note}[/]")

    f = Table(title=f"cost-model fits ({prof['target']['architecture']}: primary = "
                    f"{profiling.primary_fit_kind(prof['target']['architecture'])})")
    for col in ("method", "linear t = kN + C", "R²", "quadratic t = aN² + bN + c", "R²", "max |residual| (primary)"):
        f.add_column(col, justify="right")
    for m, fit in prof["fits"].items():
        lin, quad = fit["linear"], fit["quadratic"]
        prim = fit[fit["primary"]]
        f.add_row(m, f"k={lin['coef']['k']:.4g}, C={lin['coef']['C']:.4g}", f"{lin['r2']:.4f}",
                  f"a={quad['coef']['a']:.3g}, b={quad['coef']['b']:.4g}, c={quad['coef']['c']:.4g}",
                  f"{quad['r2']:.4f}", f"{max(abs(x) for x in prim['residuals']):.3g} ms")
    console.print(f)

    be = prof["break_even"]
    b = Table(title=f"break-even tau2/tau1 >= t(N2)/t(N1), N1 = {be['reference_n']} ({be['reference_method']})")
    b.add_column("N2", justify="right")
    for m in be["table"]:
        b.add_column(m, justify="right")
    for n in sizes:
        row = [next(("-" if r["ratio"] is None else f"{r['ratio']:.3f}" for r in be["table"][m] if r["n"] == n), "")
               for m in be["table"]]
        if any(row):  # the AR step (size 1) lies outside the fitted verify range
            b.add_row(str(n), *row)
    console.print(b)

    d = prof.get("drafter_timings")
    if d:
        levels = ", ".join(f"{x['width']}: {x['median']:.3f}" for x in d["levels"])
        console.print(f"fused draft ({d['impl']}): root (commit + step) {d['root']['median']:.3f} ms; "
                      f"one level by width (top-k + gather + step), ms: {levels}")
        it = d["iteration"]
        tree = ",".join(map(str, it["tree"]))
        if it["loop"] is None:
            console.print(f"decode loop overhead {it.get('note') or 'not measured'}")
        else:
            console.print(f"decode loop on tree {tree}: {it['loop']['median']:.3f} ms per iteration, the same iteration "
                          f"replayed back to back {it['bare']['median']:.3f} ms"
                          + ("" if it.get("predicted_bare_ms") is None else
                             f" (predicted: stree fit + fused draft = {it['predicted_bare_ms']:.3f} ms)")
                          + f"; overhead per iteration = {d['iteration_overhead_ms']:.3f} ms")
        s = Table(title=f"fused draft per config; step = verify + draft + overhead {d['iteration_overhead_ms']:.3f} ms; "
                        f"lambda_gamma = T_level(1)/T_target = {d['lambda_gamma']:.4f}")
        for col in ("config", "nodes", "level widths", "draft ms measured", "draft ms predicted (root+levels)",
                    "predicted verify ms", "predicted step ms", "lambda_gamma"):
            s.add_column(col, justify="right")
        for c in d["configs"]:
            s.add_row(",".join(map(str, c["config"])), str(c["nodes"]) + ("*" if c["extrapolated"] else ""),
                      ",".join(map(str, c["widths"])), f"{c['draft']['median']:.3f}", f"{c['composed_ms']:.3f}",
                      "" if c["predicted_verify_ms"] is None else f"{c['predicted_verify_ms']:.3f}",
                      "" if c["predicted_step_ms"] is None else f"{c['predicted_step_ms']:.3f}",
                      f"{c['lambda_gamma']:.4f}")
        console.print(s)
