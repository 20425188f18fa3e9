"""`ssmspec generate`: decode a prompt with tree-based speculative verification."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import List, Optional

import typer

from ssmspec.decoding.generate import GenerationConfig
from ssmspec.errors import InputError

from . import options

_DEFAULTS = {f.name: f.default for f in fields(GenerationConfig)}


def read_prompt(prompt: str) -> str:
    """The prompt text: the --prompt value, or stdin for `-`."""
    if prompt != "-":
        return prompt
    raw = getattr(sys.stdin, "buffer", None)  # bytes, decoded strictly whatever the locale's error handler
    try:
        # utf-8-sig: a file saved with a BOM (`--prompt - < prompt.txt`) must not start the prompt with it
        return raw.read().decode("utf-8-sig") if raw is not None else sys.stdin.read()
    except UnicodeDecodeError as e:
        raise InputError(f"--prompt -: stdin is not UTF-8 text (bad byte at offset {e.start}); convert it first, "
                         "e.g. with iconv") from None


def resolve_method_and_tree(method: Optional[str], tree: Optional[str], draft_len: Optional[int], drafter: Optional[str]):
    """Turn --method/--tree/--draft-len into a (method, Tree or None) pair, checking they agree."""
    from ssmspec.trees import Tree, parse_tree_spec

    if drafter not in (None, "ngram") and not Path(drafter).is_dir():
        raise InputError(f"--drafter {drafter} is not a model directory; pass one, or 'ngram' for prompt lookup")
    if tree is not None and draft_len is not None:
        raise InputError("give either --tree or --draft-len, not both")
    if draft_len is not None and draft_len < 1:
        raise InputError(f"--draft-len must be a positive integer, got {draft_len}")
    shape = parse_tree_spec(tree) if tree is not None else (Tree.chain(draft_len) if draft_len else None)
    if method is None and shape is not None and drafter is None:
        flag = "--tree" if tree is not None else "--draft-len"
        raise InputError(f"{flag} needs --drafter DIR (a model sharing the target's tokenizer) or --drafter ngram "
                         "to draft the tree")
    if method is None:
        method = "ar" if drafter is None else ("chain" if shape is not None and shape.is_chain else "stree")
    if method == "ar" and shape is not None:
        raise InputError("--method ar drafts nothing: drop --tree/--draft-len or choose --method chain|stree")
    if method != "ar" and drafter is None:
        raise InputError(f"--method {method} needs --drafter DIR (a model sharing the target's tokenizer) or --drafter ngram")
    return method, shape


def generate_command(
    target: Path = typer.Option(..., "--target", exists=True, file_okay=False, help="Target model directory (transformers Mamba2/NemotronH/Bamba, mamba_ssm, or ssmspec)."),
    prompt: str = typer.Option(..., "--prompt", help="Prompt text, or - to read it from stdin.", callback=options.non_empty),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter model directory, or 'ngram' for prompt lookup.",
                                          callback=options.non_empty),
    method: Optional[str] = options.choice(None, "--method", choices=("ar", "chain", "stree"),
                                           help="Decoding method (default: stree with a drafter, else ar)."),
    tree: Optional[str] = typer.Option(None, "--tree", help="Tree configuration such as 3,2,2,1, 'parents:-1,0,0', or a tree.json (or the tune-tree --out holding one)."),
    draft_len: Optional[int] = options.count(None, "--draft-len", min=1, help="Short form of --tree 1,1,...,1 (a chain of N drafted tokens)."),
    max_new_tokens: int = options.count(_DEFAULTS["max_new_tokens"], "--max-new-tokens", min=1, max=options.MAX_NEW_TOKENS,
                                        help="Stop after this many new tokens."),
    temperature: float = options.real(_DEFAULTS["temperature"], "--temperature", help="0 = greedy; > 0 samples, losslessly."),
    top_p: float = options.real(_DEFAULTS["top_p"], "--top-p", max=1.0, above=True, help="Nucleus sampling mass (1 = off)."),
    top_k: int = options.count(_DEFAULTS["top_k"], "--top-k", help="Keep the k most likely tokens (0 = off)."),
    seed: Optional[int] = options.SEED,
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable).", callback=options.non_empty),
    chat: bool = options.flag(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    as_json: bool = options.flag(False, "--json", help="Print one JSON object (text, token_ids, stats) instead of streaming."),
    graphs: Optional[bool] = options.flag(None, "--cuda-graphs/--no-cuda-graphs", help="Replay the target's calls as CUDA graphs (default: on for greedy decoding on a GPU)."),
    dtype: Optional[str] = options.DTYPE,
    device: str = options.DEVICE,
    backend: str = options.BACKEND,
) -> None:
    """Generate from a prompt; speculative methods give exactly the target's output.

    Ctrl-C stops the generation: what was produced so far and a summary are printed, and the exit status is 130.

    Examples:
        ssmspec generate --target runs/target --prompt "def fib(n):" --drafter runs/drafter --tree 3,2,1
        echo "Once upon a time" | ssmspec generate --target runs/target --prompt - --drafter ngram --draft-len 4 --json
    """
    from ssmspec.api import generate_text, load_drafter, load_target
    from ssmspec.ops import dispatch

    dispatch.set_backend(backend)
    text = read_prompt(prompt)
    method_name, shape = resolve_method_and_tree(method, tree, draft_len, drafter)
    config = GenerationConfig(method=method_name, tree=shape, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, stop_strings=tuple(stop or ()), graphs=graphs)
    loaded = load_target(target, dtype=dtype, device=device)
    drafter_obj = load_drafter(drafter, loaded) if drafter is not None else None

    shown: list[str] = []

    def stream(piece: str) -> None:
        shown.append(piece)
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    started = time.perf_counter()
    try:
        result = generate_text(loaded, text, drafter=drafter_obj, config=config, chat=chat, on_text=stream)
    except KeyboardInterrupt:
        report_interrupted(method_name, shape, "".join(shown), time.perf_counter() - started, as_json)
        raise typer.Exit(130) from None
    if as_json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats}))
        return
    sys.stdout.write("\n")
    s = result.stats
    tree_part = f", tree {s['tree']}" if s["tree"] else ""
    print(
        f"[{s['method']}{tree_part}] {s['new_tokens']} tokens in {s['elapsed_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s; "
        f"prefill {1000 * s['prefill_s']:.0f} ms, then {s['decode_tokens_per_s']:.1f} tok/s), "
        f"{s['target_calls']} target calls, {s['mean_accepted']:.2f} tokens per call, stop: {s['finish_reason']}",
        file=sys.stderr,
    )


def report_interrupted(method: str, shape, text: str, elapsed: float, as_json: bool) -> None:
    """After Ctrl-C: the text produced so far (already streamed, or as JSON) and a summary line on stderr."""
    if as_json:
        stats = {"method": method, "tree": shape.spec() if shape is not None else None, "elapsed_s": elapsed,
                 "finish_reason": "interrupted"}
        print(json.dumps({"text": text, "token_ids": None, "stats": stats}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    tree_part = f", tree {shape.spec()}" if shape is not None else ""
    print(f"[{method}{tree_part}] interrupted after {elapsed:.2f}s with {len(text)} characters of output, "
          "stop: interrupted", file=sys.stderr)
