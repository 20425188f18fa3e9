"""Prompt sets: the vendored HumanEval, MT-Bench and ShareGPT samples, and user prompt files."""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

DATA = Path(__file__).resolve().parents[1] / "data"
DATASETS = {
    # name: the vendored file (its licence beside it; data/README.md)
    "humaneval": DATA / "humaneval" / "HumanEval.jsonl.gz",
    "mt-bench": DATA / "mt-bench" / "question.jsonl",
    "sharegpt": DATA / "sharegpt" / "first_turns.jsonl.gz",
}


@dataclass
class Prompt:
    """One benchmark prompt: raw text (completed as is) or chat messages (templated when the
    tokenizer has a chat template, else their contents joined)."""

    id: str
    text: str | None = None
    messages: list[dict] | None = None


def load_prompts(dataset: str, unusable: list | None = None) -> tuple[str, list[Prompt]]:
    """(dataset name for the report, prompts) for a vendored set's name or a prompts file; a
    prompts file's records that hold no prompt are left out and, given `unusable`, listed there
    (read_prompts_file).

    Raises InputError for an unknown name, a missing file, or a file with no usable prompt.
    """
    if dataset in DATASETS:
        return dataset, _VENDORED[dataset](DATASETS[dataset])
    path = Path(dataset)
    if not path.is_file():
        if path.suffix:
            raise InputError(f"prompts file {dataset} does not exist")
        raise InputError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}, or give a prompts file (.jsonl or .txt)")
    return path.name, read_prompts_file(path, unusable)


def read_prompts_file(path: Path, unusable: list | None = None) -> list[Prompt]:
    """`.jsonl` records with `prompt` (text) or `messages` (chat), or `.txt` with one prompt a line.

    A .jsonl record with neither is left out; given `unusable`, a {"prompt_id", "reason"} entry
    per such record is appended to it (blank lines are no records)."""
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        prompts = _jsonl_prompts(path, [] if unusable is None else unusable)
    elif suffix == ".txt":
        lines = _read_lines(path)
        prompts = [Prompt(f"line{i + 1}", text=line) for i, line in enumerate(lines) if line.strip()]
    else:
        raise InputError(f"prompts file {path} must end in .jsonl or .txt")
    if not prompts:
        raise InputError(f"prompts file {path} holds no usable prompt (a .jsonl needs 'prompt' or 'messages' in its records, a .txt non-empty lines)")
    return prompts


def _jsonl_prompts(path: Path, unusable: list) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict):
            unusable.append({"prompt_id": f"{path.name}:{number}", "reason": "not a JSON object"})
            continue
        pid = str(record.get("id", record.get("task_id", f"line{number}")))
        if isinstance(record.get("prompt"), str) and record["prompt"].strip():
            prompts.append(Prompt(pid, text=record["prompt"]))
        elif _messages_ok(record.get("messages")):
            prompts.append(Prompt(pid, messages=record["messages"]))
        else:
            unusable.append({"prompt_id": f"{path.name}:{number}",
                             "reason": "no non-empty 'prompt' text or 'messages' list with contents"})
    return prompts


def _messages_ok(messages) -> bool:
    return (isinstance(messages, list) and len(messages) > 0
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
            and any(m["content"].strip() for m in messages))


def _read_lines(path: Path) -> list[str]:
    """The file's lines: a leading UTF-8 BOM dropped (editors on Windows write one), split at line
    ends only (\n, \r\n, \r). str.splitlines also splits at form feeds and U+2028, which JSON
    strings and code may hold."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8-sig") as f:  # text mode reads \r\n and \r as \n
        lines = f.read().split("\n")
    return lines[:-1] if lines[-1] == "" else lines  # the last line's end starts no line


def encode_fitting(prompts: list[Prompt], tokenizer, max_new_tokens: int, context: int | None,
                   limit: int | None = None) -> tuple[list[tuple[str, list[int]]], list[dict]]:
    """(id, token ids) of the first `limit` prompts that tokenize to something and leave room for
    `max_new_tokens` within `context` (None: no limit), and {"prompt_id", "reason"} for each
    prompt left out before the limit was reached. A record the chat template refuses is left
    out, not fatal."""
    encoded, skipped = [], []
    for prompt in prompts:
        if limit is not None and len(encoded) >= limit:
            break
        try:
            ids = encode(tokenizer, prompt)
        except InputError as e:
            skipped.append({"prompt_id": prompt.id, "reason": str(e)})
            continue
        if not ids:
            skipped.append({"prompt_id": prompt.id, "reason": "empty after tokenization"})
        elif context is not None and len(ids) + max_new_tokens > context:
            skipped.append({"prompt_id": prompt.id, "reason": f"{len(ids)} prompt tokens + {max_new_tokens} "
                            f"new tokens exceed the context of {context}"})
        else:
            encoded.append((prompt.id, ids))
    return encoded, skipped


def _humaneval(path: Path) -> list[Prompt]:
    # Code completion: the model continues the signature and docstring, no chat turn.
    return [Prompt(r["task_id"], text=r["prompt"]) for r in map(json.loads, _read_lines(path))]


def _mt_bench(path: Path) -> list[Prompt]:
    # The first turn of each question (the second needs the model's own first answer).
    return [Prompt(str(r["question_id"]), messages=[{"role": "user", "content": r["turns"][0]}])
            for r in map(json.loads, _read_lines(path))]


def _sharegpt(path: Path) -> list[Prompt]:
    return [Prompt(r["id"], messages=[{"role": "user", "content": r["prompt"]}]) for r in map(json.loads, _read_lines(path))]


_VENDORED = {"humaneval": _humaneval, "mt-bench": _mt_bench, "sharegpt": _sharegpt}


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: chat messages through the tokenizer's chat template when it has
    one (with the generation prompt), else their contents joined by blank lines. InputError
    when the template refuses the messages."""
    if prompt.text is not None:
        return list(tokenizer.encode(prompt.text))
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as e:  # raise_exception(...) in the template: roles it does not take, say
            raise InputError(f"the tokenizer's chat template refuses the messages of prompt {prompt.id}: {e}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode("\n\n".join(m["content"] for m in prompt.messages)))
