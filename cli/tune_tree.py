"""`ssmspec tune-tree`: choose a draft tree (or a bandit's arm set) from measured acceptance and profile.json."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ssmspec.errors import InputError
from ssmspec.trees.tree import TREE_FILE
from ssmspec.tuning.treefile import MODES
from ssmspec.tuning.tune import TuneSettings

from . import options, outputs

_D = TuneSettings()
STATES = ("keep", "request")
PROFILE_FILE = "profile.json"


def parse_candidates(specs: Optional[List[str]]):
    """--candidates 3,2,1 '4,2,1;2,2,1' -> Trees (configurations or parents: lists); InputError for anything else."""
    from ssmspec.trees import Tree, TreeSpecError, parse_tree_spec

    out: list[Tree] = []
    for spec in specs or []:
        for part in spec.split(";"):
            part = part.strip()
            if not part:
                raise InputError(f"{spec!r} holds an empty candidate (stray ';')")
            if part.startswith("bandit") or part.endswith(".json"):
                raise InputError(f"give tree configurations such as 3,2,1, not {part!r}")
            try:
                tree = parse_tree_spec(part)
            except TreeSpecError as e:
                raise InputError(f"malformed candidate {part!r}: {e}") from None
            if tree.parents not in {t.parents for t in out}:
                out.append(tree)
    return tuple(out)


def _check_candidates(value):
    # While parsing, so a malformed candidate is a usage error before any model loads.
    try:
        parse_candidates(value)
    except InputError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def check_models_match_profile(profile, target, drafter, force: bool) -> list[str]:
    """Refuse a profile measured on another target or drafter (or dtype); warnings instead with --force."""
    from ssmspec import profiling
    from ssmspec.errors import ProfileMismatchError

    try:
        warnings = profiling.check_profile_matches(profile, target, target.dtype, force=force)
    except ProfileMismatchError as e:
        raise InputError(str(e)) from None
    recorded = profile.to_dict().get("drafter")
    fp = profiling.model_fingerprint(drafter)
    if recorded is not None and recorded.get("fingerprint") != fp:
        problem = (f"the profile timed drafter {recorded.get('source') or recorded['fingerprint'][:12]}, not this drafter "
                   f"(fingerprint {fp[:12]})")
        if not force:
            raise InputError(problem + "; run `ssmspec profile --target DIR --drafter DIR` for these models, or pass --force")
        warnings.append(problem)
    return warnings


def tune_tree_command(
    target: Path = options.model_dir(..., "--target", help="Target model directory."),
    drafter: Path = options.model_dir(..., "--drafter", help="Drafter model directory (sharing the target's tokenizer)."),
    prompts: Path = options.input_file(..., "--prompts", help="Prompts: .txt (one per line) or .jsonl[.gz] (field prompt or messages), as `ssmspec bench --prompts`."),
    profile: Path = typer.Option(..., "--profile", exists=True,
                                 help="The --out directory of `ssmspec profile` for this target and drafter, or its profile.json."),
    mode: str = options.choice(_D.mode, "--mode", choices=MODES, help="static, bandit, or both (write whichever decoded faster)."),
    budget: int = options.count(_D.budget, "--budget", min=2, max=1024, help="Most tree nodes, root included."),
    max_depth: int = options.count(_D.max_depth, "--max-depth", min=1, max=64, help="Deepest draft level."),
    width: int = options.count(_D.width, "--width", min=1, max=64, help="Most children per node (sibling ranks measured)."),
    candidates: Optional[List[str]] = typer.Option(None, "--candidates", callback=_check_candidates,
                                                   help="Trees to rank and bandit arms, e.g. 3,2,1 or '4,2,1;3,2,2,1,1' (repeatable; default: every configuration under the budget)."),
    temperature: float = options.real(_D.temperature, "--temperature", help="Sampling temperature to tune for (0 = greedy)."),
    max_new_tokens: int = options.count(_D.max_new_tokens, "--max-new-tokens", min=1, max=options.MAX_NEW_TOKENS,
                                        help="Tokens per prompt for statistics and each measured decode."),
    verify_top: int = options.count(_D.verify_top, "--verify-top", max=64, help="Best predicted trees verified by decoding (0 = trust the prediction)."),
    arms: int = options.count(_D.arms, "--arms", min=1, max=64, help="Bandit arms without --candidates: the best predicted tree of each depth, best first."),
    lambda_ucb: float = options.real(_D.lambda_ucb, "--lambda-ucb", help="UCB exploration weight."),
    lambda_gamma: Optional[float] = options.real(_D.lambda_gamma, "--lambda-gamma", help="Draft cost per level over a target call (default: the profile's fused draft level at width 1 over its AR step)."),
    state: str = options.choice(_D.state, "--state", choices=STATES, help="Written bandit: keep (learn across requests) or request (reset per request)."),
    out: Path = typer.Option(Path("tune-tree"), "--out", help="Output directory for tree.json (and bandit.png)."),
    overwrite: bool = options.flag(False, "--overwrite", help="Replace an earlier `ssmspec tune-tree` output in --out."),
    plot: bool = options.flag(False, "--plot", help="Draw the bandit's pulls and rewards over time (bandit.png)."),
    force: bool = options.flag(False, "--force", help="Use a profile of other models or dtype anyway (with a warning)."),
    seed: int = options.count(_D.seed, "--seed", help="Seed of sampled decoding."),
    dtype: Optional[str] = options.DTYPE,
    device: str = options.DEVICE,
    backend: str = options.BACKEND,
) -> None:
    """Measure acceptance per depth and rank, rank trees by predicted tokens/s, verify the best, run the UCB bandit.

    Ctrl-C stops the tuning without writing anything; the exit status is 130.

    Examples:
        ssmspec tune-tree --target runs/target --drafter runs/drafter --prompts prompts.txt --profile runs/profile --out runs/tune
        ssmspec generate --target runs/target --drafter runs/drafter --tree runs/tune/tree.json --prompt "def fib(n):"
    """
    from rich.console import Console

    from ssmspec import profiling
    from ssmspec.api import load_target
    from ssmspec.models.loading import check_same_vocab, load_model
    from ssmspec.ops import dispatch
    from ssmspec.benchmark.prompts import encode_fitting, read_prompts_file
    from ssmspec.limits import context_limit, declared_context
    from ssmspec.tokenization import tokenizer_for
    from ssmspec.tuning.static import CostModel
    from ssmspec.tuning.treefile import write_tree_file
    from ssmspec.tuning.tune import tune

    console = Console(stderr=True)
    settings = TuneSettings(mode=mode, budget=budget, max_depth=max_depth, width=width, temperature=temperature,
                            max_new_tokens=max_new_tokens, verify_top=verify_top, arms=arms, lambda_ucb=lambda_ucb,
                            lambda_gamma=lambda_gamma, state=state, seed=seed, candidates=parse_candidates(candidates))
    settings.validate()
    outputs.claim(out, "tune-tree", inputs={"--target": target, "--drafter": drafter, "--prompts": prompts,
                                            "--profile": profile}, overwrite=overwrite)
    unusable: list[dict] = []
    prompt_items = read_prompts_file(prompts, unusable)
    for entry in unusable:
        console.print(f"[yellow]skipped[/] {entry['prompt_id']}: {entry['reason']}")
    profile_file = profile / PROFILE_FILE if profile.is_dir() else profile
    prof = profiling.load_profile(profile_file)
    dispatch.set_backend(backend)
    loaded = load_target(target, dtype=dtype, device=device)
    drafter_loaded = load_model(drafter, dtype=loaded.model.dtype, device=loaded.model.device)
    check_same_vocab(loaded, drafter_loaded, "target", "drafter")
    for warning in check_models_match_profile(prof, loaded.model, drafter_loaded.model, force):
        console.print(f"[yellow]warning:[/] {warning}")
    cost = CostModel.from_profile(prof)
    tokenizer = tokenizer_for(loaded)
    # As bench: prompts that do not fit the context the model declares (with the tokens each
    # measurement generates) are reported and left out, not measured past the context.
    context = context_limit(loaded.model.config, declared_context(target))[0]
    encoded, skipped = encode_fitting(prompt_items, tokenizer, max_new_tokens, context)
    for entry in skipped:
        console.print(f"[yellow]skipped[/] {entry['prompt_id']}: {entry['reason']}")
    ids = [prompt_ids for _, prompt_ids in encoded]
    if not ids and skipped:
        raise InputError(f"no prompt of {prompts} fits: {skipped[0]['reason']}")

    try:
        with console.status("tuning") as status:
            def progress(label: str, done: int, total: int) -> None:
                status.update(f"{label} ({done}/{total})")

            result = tune(loaded.model.eval(), drafter_loaded.model.eval(), ids, cost, settings, progress=progress)
    except KeyboardInterrupt:
        print("tune-tree interrupted; nothing written", file=sys.stderr)
        raise typer.Exit(130) from None

    meta = {"target": {"fingerprint": profiling.model_fingerprint(loaded.model), "source": str(target)},
            "drafter": {"fingerprint": profiling.model_fingerprint(drafter_loaded.model), "source": str(drafter)},
            "profile": {"path": str(profile_file), "device": prof.device_name, "dtype": prof.dtype}}
    path = write_tree_file(result.to_json(settings, meta), out / TREE_FILE)
    render(result, settings, Console())
    if plot and result.policy is not None:
        from ssmspec.tuning.plot import plot_bandit

        console.print(f"wrote {plot_bandit(result.policy, out / 'bandit.png')}")
    outputs.mark(out, "tune-tree")
    console.print(f"wrote {path}; use it with `ssmspec generate --tree {path}`")


def render(result, settings, console) -> None:
    """Rich tables: acceptance by depth and rank, predicted ranking, predicted vs measured, the bandit's arms."""
    from rich.table import Table

    for stats in result.stats.values():
        a = stats.acceptance()
        t = Table(title=f"acceptance P(rank r accepted | parent accepted), T={stats.temperature:g}, "
                        f"{stats.prompts} prompts, {stats.tokens} positions")
        t.add_column("depth", justify="right")
        for r in range(stats.width):
            t.add_column(f"r{r}", justify="right")
        t.add_column("reached", justify="right")
        for d, row in enumerate(a):
            t.add_row(str(d + 1), *(f"{x:.3f}" for x in row), f"{stats.reached[d]:.0f}")
        console.print(t)

    t = Table(title=f"predicted (T={settings.temperature:g}, budget {settings.budget}, depth <= {settings.max_depth})"
                    + (f"; AR step {result.ar_tokens_per_s:.1f} tok/s" if result.ar_tokens_per_s else ""))
    t.caption = "step ms = target (stree fit) + draft (fused: root + levels) + overhead (the loop's, per iteration)"
    for col in ("#", "tree", "nodes", "depth", "exp. tok/step", "target", "draft", "overhead", "step ms", "pred tok/s"):
        t.add_column(col, justify="right")
    for i, p in enumerate(result.predictions[:15], 1):
        t.add_row(str(i), p.tree.spec(), str(p.tree.num_nodes) + ("*" if p.extrapolated else ""), str(p.tree.max_depth),
                  f"{p.expected_tokens:.3f}", f"{p.target_ms:.3f}", f"{p.draft_ms:.3f}", f"{p.overhead_ms:.3f}",
                  f"{p.step_ms:.3f}", f"{p.tokens_per_s:.1f}")
    console.print(t)
    if any(p.extrapolated for p in result.predictions[:15]):
        console.print("[dim]* more nodes than the profile measured: its fit is extrapolated[/]")

    if result.measured:
        m = Table(title="verified by decoding (decode tokens/s)")
        for col in ("tree", "pred tok/s", "meas. tok/s", "error", "pred tok/step", "meas. tok/step", "pred step ms",
                    "meas. step ms"):
            m.add_column(col, justify="right")
        for x in result.measured:
            j = x.to_json()
            m.add_row(j["tree"], f"{j['predicted_tokens_per_s']:.1f}", f"{j['measured_tokens_per_s']:.1f}",
                      "" if j["error"] is None else f"{100 * j['error']:+.1f}%", f"{j['predicted_tokens']:.3f}",
                      f"{j['measured_tokens']:.3f}",
                      f"{j['predicted_step_ms']:.3f}",
                      "" if j["measured_step_ms"] is None else f"{j['measured_step_ms']:.3f}")
        console.print(m)
    if result.policy is not None:
        s = result.policy.summary()
        b = Table(title=f"bandit (lambda_ucb {result.policy.lambda_ucb:g}, lambda_gamma {result.lambda_gamma:.4f}): "
                        f"{s['rounds']} steps, {result.bandit_tokens_per_s:.1f} decode tok/s"
                        + ("" if result.bandit_overhead is None else f", policy overhead {100 * result.bandit_overhead:.2f}% of a step"))
        for col in ("arm", "pulls", "mean reward", "mean tokens/step"):
            b.add_column(col, justify="right")
        for arm, n, r, tok in zip(result.policy.arms, s["pulls"], s["mean_reward"], s["mean_tokens"]):
            b.add_row(arm.spec(), str(n), "" if r is None else f"{r:.4f}", "" if tok is None else f"{tok:.3f}")
        console.print(b)
    from rich.markup import escape

    console.print(f"[bold]chosen[/]: {escape(result.choice.spec())}")
