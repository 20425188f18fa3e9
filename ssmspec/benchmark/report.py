"""Aggregate a run per method and write it out: results.jsonl, summary.json, report.md."""
from __future__ import annotations

import json
from pathlib import Path

from .lossless import TIE_ULPS
from .runner import BenchResult

SPLIT_KEYS = ("prefill_s", "draft_s", "verify_s", "host_s")
HEADERS = ("method", "tok/s (vs ar)", "tok/call", "decode tok/s", "target calls", "prefill/draft/verify/host",
           "peak mem", "lossless")


def summarize(result: BenchResult) -> dict[str, dict]:
    """label -> aggregates over the prompts it finished. Rates are totals over totals (total
    tokens / total time), never means of per-prompt rates."""
    out: dict[str, dict] = {}
    for spec in result.methods:
        rows = [r for r in result.records if r["method"] == spec.label]
        if not rows:
            continue
        new = sum(r["new_tokens"] for r in rows)
        elapsed = sum(r["elapsed_s"] for r in rows)
        prefill = sum(r["prefill_s"] for r in rows)
        calls = sum(r["target_calls"] for r in rows)
        statuses = [r["lossless"]["status"] for r in rows]
        info = result.method_info.get(spec.label, {})
        out[spec.label] = {
            "method": spec.method, "tree": None if spec.tree is None else spec.tree.spec(), "prompts": len(rows),
            "new_tokens": new, "elapsed_s": elapsed, "prefill_s": prefill, "target_calls": calls,
            "tokens_per_s": new / elapsed if elapsed > 0 else 0.0,
            # Decoding alone: tokens after each prompt's first, over the time after its prefill.
            "decode_tokens_per_s": (new - len(rows)) / (elapsed - prefill) if elapsed > prefill else 0.0,
            "tokens_per_call": (new - len(rows)) / calls if calls else 0.0,
            "lossless": {s: statuses.count(s) for s in ("match", "tie", "failure", "reference", "n/a") if s in statuses},
            "peak_memory_bytes": info.get("peak_memory_bytes"),
            "time_split": info.get("time_split"),
        }
    # Against ar on the same prompts: an interrupted method finished only the first few (prompts
    # run in the same order for every method), and tokens/s differs from prompt to prompt.
    ar_rows = [r for r in result.records if r["method"] == "ar"]
    for summary in out.values():
        same = ar_rows[:summary["prompts"]]
        ar_elapsed = sum(r["elapsed_s"] for r in same)
        ar_rate = sum(r["new_tokens"] for r in same) / ar_elapsed if ar_elapsed > 0 else 0.0
        summary["speedup"] = summary["tokens_per_s"] / ar_rate if ar_rate > 0 else None
    return out


def table_rows(summaries: dict[str, dict]) -> list[tuple[str, ...]]:
    """The table as strings, one row per method, in HEADERS' order (the CLI and report.md share it)."""
    rows = []
    for label, s in summaries.items():
        speed = f"{s['tokens_per_s']:.0f}" + (f" ({s['speedup']:.2f}x)" if s["speedup"] is not None else "")
        rows.append((label, speed, f"{s['tokens_per_call']:.2f}", f"{s['decode_tokens_per_s']:.0f}", str(s["target_calls"]),
                     _split(s["time_split"]), _memory(s["peak_memory_bytes"]), _lossless(s["lossless"], s["prompts"])))
    return rows


def _split(split: dict | None) -> str:
    if not split:
        return "-"
    total = sum(split.get(k, 0.0) for k in SPLIT_KEYS)
    if total <= 0:
        return "-"
    return "/".join(f"{100 * split.get(k, 0.0) / total:.0f}" for k in SPLIT_KEYS) + " %"


def _memory(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def _lossless(counts: dict, prompts: int) -> str:
    if "reference" in counts:
        return "reference"
    if "n/a" in counts:
        return "n/a (T > 0)"
    parts = [f"{counts.get('match', 0)}/{prompts} exact"]
    if counts.get("tie"):
        parts.append(f"{counts['tie']} ties")
    if counts.get("failure"):
        parts.append(f"{counts['failure']} FAILED")
    return ", ".join(parts)


def summary_dict(result: BenchResult) -> dict:
    summaries = summarize(result)
    statuses = [r["lossless"]["status"] for r in result.records]
    return {
        "dataset": result.dataset, "config": result.config.to_dict(), "environment": result.environment,
        "methods": summaries, "notes": result.notes, "skipped": result.skipped, "interrupted": result.interrupted,
        "lossless": {"applicable": result.lossless_applicable, "failures": statuses.count("failure"),
                     "ties": statuses.count("tie")},
    }


def markdown(result: BenchResult) -> str:
    """report.md: configuration, device and versions, the table, and every tie and failure."""
    cfg, env = result.config, result.environment
    lines = [f"# ssmspec bench: {result.dataset}", ""]
    if result.interrupted:
        lines += ["**Interrupted**: the tables hold the prompts that finished.", ""]
    lines += ["## Configuration", ""]
    # lists joined with "; ": a tree spec holds commas itself
    lines += [f"- {k}: `{'; '.join(map(str, v)) if isinstance(v, (tuple, list)) else v}`" for k, v in cfg.to_dict().items()]
    lines += ["", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if v is not None]
    summaries = summarize(result)
    prompts = max((s["prompts"] for s in summaries.values()), default=0)
    lines += ["", f"## Results ({prompts} prompts, {cfg.max_new_tokens} new tokens, temperature {cfg.temperature})", ""]
    lines += ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(HEADERS))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summaries)]
    lines += ["", "tokens/s: end to end (prefill included), total tokens over total time; tokens/call: tokens per "
              "decoding target call (accepted drafts + 1); time split: percent of an untimed pass with "
              "`--time-split` (- where not measured)."]
    lines += ["", "## Losslessness", ""]
    if not result.lossless_applicable:
        lines.append("Not applicable at temperature > 0: outputs are samples, not comparable id for id.")
    else:
        odd = [r for r in result.records if r["lossless"]["status"] in ("tie", "failure")]
        tol = (f"{cfg.tie_tolerance:g} (given)" if cfg.tie_tolerance is not None
               else f"{TIE_ULPS} units in the last place of {env.get('dtype')} at the two logits' magnitude")
        lines.append(f"Every speculative method's ids compared with ar's, per prompt: {sum(r['lossless']['status'] == 'failure' for r in odd)} "
                     f"failures, {sum(r['lossless']['status'] == 'tie' for r in odd)} numerical ties. In fp32 any difference "
                     f"is a failure; in bf16/fp16 a divergence is a tie when the target's fp32 logits of the two tokens "
                     f"on the shared prefix differ by at most the tie tolerance: {tol}.")
        for r in odd:
            v = r["lossless"]
            detail = ", ".join(f"{k} {v[k]:.4g}" if isinstance(v[k], float) else f"{k} {v[k]}" for k in v if k != "status")
            lines.append(f"- {r['method']} / {r['prompt_id']}: **{v['status']}** ({detail})")
    if result.notes or result.skipped:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in result.notes]
        lines += [f"- skipped {s['prompt_id']}: {s['reason']}" for s in result.skipped]
    return "\n".join(lines) + "\n"


def write_outputs(result: BenchResult, out_dir: str | Path) -> dict[str, Path]:
    """results.jsonl (one line per method and prompt), summary.json and report.md in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.jsonl", "summary": out / "summary.json", "report": out / "report.md"}
    with paths["results"].open("w") as f:
        for record in result.records:
            f.write(json.dumps(record) + "\n")
    paths["summary"].write_text(json.dumps(summary_dict(result), indent=2) + "\n")
    paths["report"].write_text(markdown(result))
    return paths
