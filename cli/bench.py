"""`ssmspec bench`: tokens/s of ar, chain and stree on a prompt set, with every output checked against ar."""
from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import List, Optional

import typer

from ssmspec.benchmark.config import BenchConfig
from ssmspec.benchmark.prompts import DATASETS
from ssmspec.decoding.generate import METHODS

from . import options, outputs

_DEFAULTS = {f.name: f.default for f in fields(BenchConfig)}
DEFAULT_OUT = Path("bench-results")


def bench_command(
    target: Path = options.model_dir(..., "--target", help="Target model directory."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter model directory, or 'ngram' for prompt lookup.",
                                          callback=options.drafter_or_ngram),
    dataset: Optional[str] = options.choice(None, "--dataset", choices=tuple(DATASETS),
                                            help=f"Vendored prompt set (default: {_DEFAULTS['dataset']}); --prompts takes a file instead."),
    prompts: Optional[Path] = options.input_file(None, "--prompts", help="Prompts file: .jsonl with 'prompt' or 'messages' per record, or .txt with one prompt a line."),
    methods: str = typer.Option(",".join(_DEFAULTS["methods"]), "--methods", callback=options.comma_choices(METHODS, "method"),
                                help="Comma-separated methods: ar, chain, stree (ar always runs first at temperature 0)."),
    tree: Optional[List[str]] = typer.Option(None, "--tree", callback=options.tree_specs,
                                             help="A tree for stree, such as 3,2,1 or a tree.json or tune-tree's --out (repeatable: one row each)."),
    draft_len: Optional[List[int]] = options.count(None, "--draft-len", min=1, help="A chain's draft length (repeatable: one row each; default 4)."),
    max_new_tokens: int = options.count(_DEFAULTS["max_new_tokens"], "--max-new-tokens", min=1, max=options.MAX_NEW_TOKENS,
                                        help="New tokens per prompt."),
    temperature: float = options.real(_DEFAULTS["temperature"], "--temperature", help="0 = greedy (outputs checked against ar); > 0 samples."),
    limit: Optional[int] = options.count(_DEFAULTS["limit"], "--limit", min=1, help="Run the first K prompts that fit (default: all)."),
    seed: int = options.count(_DEFAULTS["seed"], "--seed", help="Sampling seed of every generation."),
    warmup: int = options.count(_DEFAULTS["warmup"], "--warmup", help="Prompts run once untimed per method first (compiles, graph captures)."),
    tie_tolerance: Optional[float] = options.real(_DEFAULTS["tie_tolerance"], "--tie-tolerance", help="Largest fp32 logit gap at a bf16/fp16 divergence called a numerical tie (default: 4 ulps of the dtype at the logits' magnitude)."),
    time_split: bool = options.flag(_DEFAULTS["time_split"], "--time-split", help="Add an untimed pass per method that splits time into prefill/draft/verify/host."),
    max_context: Optional[int] = options.count(_DEFAULTS["max_context"], "--max-context", min=1, help="Skip prompts whose length + max-new-tokens exceeds this (default: the model's limit, if any)."),
    out: Path = typer.Option(DEFAULT_OUT, "--out", help="Directory for results.jsonl, summary.json and report.md."),
    overwrite: bool = options.flag(False, "--overwrite", help="Replace an earlier `ssmspec bench` output in --out."),
    dtype: Optional[str] = options.DTYPE,
    device: str = options.DEVICE,
    backend: str = options.BACKEND,
) -> None:
    """Benchmark decoding methods on a prompt set; exits 1 if any output differs from ar's beyond a numerical tie.

    Ctrl-C stops the run: the prompts that finished are written, and the exit status is 130.

    Examples:
        ssmspec bench --target runs/target --drafter runs/drafter --dataset humaneval --tree 3,2,1 --tree 2,2,2,1,1,1 --limit 40
        ssmspec bench --target runs/target --drafter ngram --prompts my_prompts.jsonl --methods ar,chain --draft-len 6
    """
    from ssmspec.benchmark import report, run_bench
    from ssmspec.errors import InputError

    if dataset is not None and prompts is not None:
        raise InputError("give either --dataset or --prompts, not both")
    config = BenchConfig(
        target=str(target), drafter=drafter, dataset=str(prompts) if prompts is not None else (dataset or _DEFAULTS["dataset"]),
        methods=tuple(m.strip() for m in methods.split(",")), trees=tuple(tree or ()), draft_lens=tuple(draft_len or ()),
        max_new_tokens=max_new_tokens, temperature=temperature, limit=limit, seed=seed, warmup=warmup, dtype=dtype,
        device=device, backend=backend, tie_tolerance=tie_tolerance, time_split=time_split, max_context=max_context,
    )
    drafter_dir = None if drafter in (None, "ngram") else Path(drafter)
    outputs.claim(out, "bench", inputs={"--target": target, "--drafter": drafter_dir, "--prompts": prompts},
                  overwrite=overwrite)
    try:
        result = _run_with_progress(run_bench, config)
    except KeyboardInterrupt:
        print("interrupted before any prompt finished; nothing written", file=sys.stderr)
        raise typer.Exit(130) from None
    paths = report.write_outputs(result, out)
    outputs.mark(out, "bench")
    _render(result, report)
    print(f"wrote {paths['results']}, {paths['summary']}, {paths['report']}", file=sys.stderr)
    if result.interrupted:
        print("interrupted: the outputs hold the prompts that finished", file=sys.stderr)
        raise typer.Exit(130)
    if result.failures:
        print(f"error: {result.failures} losslessness failure(s): a speculative method's output differs from ar's "
              f"beyond a numerical tie (see {paths['report']})", file=sys.stderr)
        raise typer.Exit(1)


def _run_with_progress(run_bench, config):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.console import Console

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def on_progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        return run_bench(config, on_progress=on_progress)


def _render(result, report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or logged: keep each row on one line
    summaries = report.summarize(result)
    prompts = max((s["prompts"] for s in summaries.values()), default=0)
    table = Table(title=f"{result.dataset}: {prompts} prompts, {result.config.max_new_tokens} new tokens, "
                        f"T={result.config.temperature}, {result.environment['device']}, {result.environment['dtype']}")
    for i, header in enumerate(report.HEADERS):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in report.table_rows(summaries):
        table.add_row(*row)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", style="dim")
    for skipped in result.skipped:
        console.print(f"skipped {skipped['prompt_id']}: {skipped['reason']}", style="yellow")
