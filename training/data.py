"""Training data: read records from files or the hub, tokenize (chat turns masked), pack into blocks, split.

A data spec is one or more comma-separated paths (files or folders of .jsonl, .json, .txt,
.parquet, optionally .gz) or a datasets-library name. Records become token streams with a
per-token loss mask; streams are packed end to end into blocks of L+1 tokens (L inputs, L
shifted targets). Block i goes to the held-out set when the running share of held-out blocks
falls below `held_out_fraction` (spread evenly over the data, decided without knowing its size).
"""
from __future__ import annotations

import gzip
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from ssmspec.errors import DataError

from .config import DataConfig

log = logging.getLogger("ssmspec.training")

EXTENSIONS = (".jsonl", ".json", ".txt", ".parquet")
IGNORE_INDEX = -100
# Used when a tokenizer has no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "system": "system", "model": "assistant"}
_ROLES = ("system", "user", "assistant", "tool")
_TXT_PIECE_CHARS = 1 << 16  # long text files are yielded in pieces of about this size, cut at line ends


# -- bad records --------------------------------------------------------------------------------
@dataclass
class BadRecords:
    """Counts malformed records and either stops at the first (error) or reports each (skip)."""

    policy: str = "error"
    count: int = 0
    examples: list[str] = field(default_factory=list)
    report: Callable[[str], None] | None = None
    max_reported: int = 20
    _seen: set = field(default_factory=set, repr=False)

    def __call__(self, where: str, reason: str) -> None:
        message = f"{where}: {reason}"
        if self.policy == "error":
            raise DataError(f"malformed record at {message} (pass --on-bad-record skip to skip such records)")
        if where in self._seen:  # streaming re-reads files each epoch; report each record once
            return
        self._seen.add(where)
        self.count += 1
        if len(self.examples) < self.max_reported:
            self.examples.append(message)
            text = f"skipped malformed record at {message}"
            log.warning(text)
            if self.report is not None:
                self.report(text)
        elif self.count == self.max_reported + 1:
            text = "more malformed records skipped; the total is reported at the end"
            log.warning(text)
            if self.report is not None:
                self.report(text)


# -- finding and reading files --------------------------------------------------------------------
def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for ext in EXTENSIONS:
        if name.endswith(ext):
            return ext
    return None


def resolve_files(spec: str) -> list[Path] | str:
    """The data files a spec names (sorted, folders walked), or the spec itself for a hub dataset."""
    files: list[Path] = []
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise DataError("the data spec is empty: give a file, a folder, or a datasets-library name")
    for part in parts:
        path = Path(part).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) and not p.name.startswith("."))
            if not found:
                raise DataError(f"{path}: no {', '.join(EXTENSIONS)} files in this folder")
            files.extend(found)
        elif path.is_file():
            if _kind(path) is None:
                raise DataError(f"{path}: unsupported file type; use one of {', '.join(EXTENSIONS)} (optionally .gz)")
            files.append(path)
        elif len(parts) == 1 and not part.startswith((".", "/", "~")) and not _kind(path):
            return part  # not a local path: try it as a datasets-library name
        else:
            raise DataError(f"{path}: no such file or folder")
    return files


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _iter_jsonl(path: Path, bad: BadRecords) -> Iterator[tuple[object, str]]:
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield json.loads(raw.decode("utf-8")), where
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                bad(where, f"not valid JSON ({e})")


def _iter_json(path: Path, bad: BadRecords) -> Iterator[tuple[object, str]]:
    """A JSON array of records (read element by element, so a truncated file keeps its whole records) or one record."""
    with _open_binary(path) as f:
        try:
            text = f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            bad(f"{path}:byte {e.start}", "not valid UTF-8")
            return
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text):
        return
    if text[pos] != "[":
        try:
            obj, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            bad(f"{path}:{e.lineno}", f"not valid JSON ({e.msg})")
            return
        records = obj.get("data") if isinstance(obj, dict) and isinstance(obj.get("data"), list) else [obj]
        for i, rec in enumerate(records):
            yield rec, f"{path}:record {i + 1}"
        return
    pos, line = pos + 1, text.count("\n", 0, pos) + 1
    while True:
        new = _skip_ws(text, pos)
        line += text.count("\n", pos, new)
        pos = new
        if pos >= len(text):
            bad(f"{path}:{line}", "the JSON array ends early (truncated file); records before this point were kept")
            return
        if text[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            bad(f"{path}:{e.lineno}", f"not valid JSON ({e.msg}); the rest of this file is skipped")
            return
        yield obj, f"{path}:{line}"
        line += text.count("\n", pos, end)
        pos = _skip_ws(text, end)
        line += text.count("\n", end, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos < len(text) and text[pos] == "]":
            return
        elif pos < len(text):
            bad(f"{path}:{line}", f"expected ',' or ']' between records, found {text[pos]!r}; the rest of this file is skipped")
            return


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _iter_txt(path: Path, bad: BadRecords, text_field: str = "text") -> Iterator[tuple[object, str]]:
    """One document per file, yielded in pieces cut at line ends so huge files stream.

    Each piece is a record whose `text_field` holds the text, so --text-field (meant for .jsonl and
    other records) does not make .txt files beside them unreadable.
    """
    piece: list[str] = []
    size, start = 0, 1
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                bad(f"{path}:{lineno}", "not valid UTF-8")
                continue
            piece.append(line)
            size += len(line)
            if size >= _TXT_PIECE_CHARS:
                yield {text_field: "".join(piece), "_continues": True}, f"{path}:{start}"
                piece, size, start = [], 0, lineno + 1
    if piece:
        yield {text_field: "".join(piece)}, f"{path}:{start}"


def _iter_parquet(path: Path, bad: BadRecords) -> Iterator[tuple[object, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    row = 0
    for batch in pf.iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            row += 1
            yield rec, f"{path}:row {row}"


def _iter_hub(name: str, split: str) -> Iterator[tuple[object, str]]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{name!r} is not a local file or folder, and reading hub datasets needs `datasets` (pip install datasets)") from e
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # offline, unknown name, ...: one message for all
        raise DataError(f"{name!r} is neither a local file or folder nor a loadable datasets-library dataset ({type(e).__name__}: {e})") from e
    for i, rec in enumerate(ds):
        yield rec, f"{name}[{split}]:row {i + 1}"


def iter_records(spec: str, bad: BadRecords, hub_split: str = "train", text_field: str = "text") -> Iterator[tuple[object, str]]:
    """Every record of the spec with its location ("file:line", "file:row n", ...); .txt text under `text_field`."""
    files = resolve_files(spec)
    if isinstance(files, str):
        yield from _iter_hub(files, hub_split)
        return
    readers = {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet,
               ".txt": lambda path, bad: _iter_txt(path, bad, text_field)}
    for path in files:
        yield from readers[_kind(path)](path, bad)


# -- records to token streams ------------------------------------------------------------------------
class RecordError(ValueError):
    """A record whose content is malformed (reported with its location by the caller)."""


def _messages(record: dict) -> list[dict]:
    """ShareGPT `conversations` (from/value) or `messages` (role/content) as role/content dicts."""
    if "messages" in record:
        raw, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        raw, role_key, content_key = record["conversations"], "from", "value"
    else:  # --format chat given for text records (a .txt file, say)
        raise RecordError("a chat record needs a 'messages' or 'conversations' field")
    if not isinstance(raw, list) or not raw:
        raise RecordError("the conversation is not a non-empty list")
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise RecordError(f"turn {i + 1} is not an object")
        role, content = turn.get(role_key, turn.get("role")), turn.get(content_key, turn.get("content"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise RecordError(f"turn {i + 1} lacks a string {role_key!r} or {content_key!r}")
        role = _SHAREGPT_ROLES.get(role.lower(), role.lower())
        if role not in _ROLES:
            raise RecordError(f"turn {i + 1} has unknown role {turn.get(role_key)!r}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise RecordError("the conversation has no assistant turn to train on")
    return out


def record_format(record: object, text_field: str) -> str:
    """Which of text, chat, tokens a record looks like (for --format auto)."""
    if isinstance(record, str):
        return "text"
    if isinstance(record, dict):
        if "input_ids" in record:
            return "tokens"
        if "messages" in record or "conversations" in record:
            return "chat"
        if text_field in record:
            return "text"
    raise RecordError(f"cannot tell the record's format: expected a {text_field!r}, 'messages', 'conversations' or 'input_ids' field")


class Tokenize:
    """Turns a record into (token ids, loss mask) lists; the mask marks tokens the loss trains on."""

    def __init__(self, tokenizer, vocab_size: int, fmt: str = "auto", text_field: str = "text"):
        self.tok = tokenizer
        self.vocab_size = vocab_size
        self.fmt = fmt
        self.text_field = text_field
        self.eos = None if tokenizer is None else tokenizer.eos_token_id
        self.template = None
        if tokenizer is not None:
            self.template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE

    def __call__(self, record: object) -> tuple[list[int], list[bool]]:
        fmt = self.fmt if self.fmt != "auto" else record_format(record, self.text_field)
        if fmt == "tokens":
            return self._tokens(record)
        if self.tok is None:
            raise DataError("this data holds text, but no tokenizer was found: the model directories hold none; pass --tokenizer DIR")
        if fmt == "chat":
            if not isinstance(record, dict):
                raise RecordError("a chat record must be an object with 'messages' or 'conversations'")
            return self._chat(_messages(record))
        text = record if isinstance(record, str) else (record.get(self.text_field) if isinstance(record, dict) else None)
        if not isinstance(text, str):
            raise RecordError(f"no string field {self.text_field!r}")
        ids = self._encode(text)
        if self.eos is not None and not (isinstance(record, dict) and record.get("_continues")):
            ids.append(self.eos)
        return ids, [True] * len(ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _tokens(self, record) -> tuple[list[int], list[bool]]:
        ids = record.get("input_ids") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RecordError("'input_ids' is not a non-empty list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RecordError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        mask = record.get("loss_mask")
        if mask is None:
            mask = [True] * len(ids)
        elif not isinstance(mask, list) or len(mask) != len(ids):
            raise RecordError("'loss_mask' must be a list as long as 'input_ids'")
        return list(ids), [bool(m) for m in mask]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not hasattr(self.tok, "apply_chat_template"):  # the byte fallback: render the template as transformers does
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt)
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.template
        )

    def _chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """The chat template's text, cut into segments by rendering growing prefixes of the conversation.

        For an assistant turn i the text between render(turns < i, generation prompt) and
        render(turns <= i) is its content and end-of-turn marker: those tokens are trained on;
        the assistant header, system and user turns are not.
        """
        ids: list[int] = []
        mask: list[bool] = []
        done = ""
        for i, m in enumerate(messages):
            full = self._render(messages[: i + 1], False)
            if m["role"] == "assistant":
                header = self._render(messages[:i], True) if i else self._render([], True)
                if header.startswith(done) and full.startswith(header):
                    self._extend(ids, mask, header[len(done):], False)
                    self._extend(ids, mask, full[len(header):], True)
                    done = full
                    continue
            if not full.startswith(done):
                raise RecordError("the chat template does not render the conversation as a growing prefix; cannot mask turns")
            self._extend(ids, mask, full[len(done):], m["role"] == "assistant")
            done = full
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
            mask.append(mask[-1] if mask else False)
        return ids, mask

    def _extend(self, ids: list, mask: list, text: str, train: bool) -> None:
        if text:
            new = self._encode(text)
            ids.extend(new)
            mask.extend([train] * len(new))


# -- packing into blocks ------------------------------------------------------------------------------
def pack(examples: Iterable[tuple[list[int], list[bool]]], seq_len: int,
         report: Callable[[str], None] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate token streams and cut blocks of seq_len + 1 tokens (consecutive blocks overlap by one).

    Yields:
        ids (L+1,) int64 and loss_mask (L,) bool: position t predicts ids[t + 1], counted when loss_mask[t].
        A final partial block is dropped unless no full block was made (then it is padded, masked,
        and `report` told when most of the block is padding: the memory goes with seq_len).
    """
    buf_ids: list[int] = []
    buf_mask: list[bool] = []
    made = 0
    for ids, mask in examples:
        buf_ids.extend(ids)
        buf_mask.extend(mask)
        while len(buf_ids) >= seq_len + 1:
            block_ids, block_mask = buf_ids[: seq_len + 1], buf_mask[1 : seq_len + 1]
            yield torch.tensor(block_ids, dtype=torch.long), torch.tensor(block_mask, dtype=torch.bool)
            made += 1
            # Keep the block's last token: it is the next block's first input.
            buf_ids, buf_mask = buf_ids[seq_len:], buf_mask[seq_len:]
    if made == 0 and len(buf_ids) >= 2:
        pad = seq_len + 1 - len(buf_ids)
        if report is not None and 2 * pad > seq_len:
            report(f"the data holds {len(buf_ids)} tokens, less than one --seq-len block of {seq_len}: training on "
                   f"one block padded with {pad} masked positions (a --seq-len near {len(buf_ids) - 1} trains the "
                   "same in far less memory)")
        ids = torch.tensor(buf_ids + [0] * pad, dtype=torch.long)
        mask = torch.tensor(buf_mask[1:] + [False] * pad, dtype=torch.bool)
        yield ids, mask


def is_held_out(index: int, fraction: float) -> bool:
    """Block `index` is held out when it moves floor(fraction * count) up: an even spread."""
    return fraction > 0 and math.floor((index + 1) * fraction) > math.floor(index * fraction)


def _blocks(cfg: DataConfig, tokenize: Tokenize, bad: BadRecords) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    def examples():
        for record, where in iter_records(cfg.spec, bad, cfg.hub_split, cfg.text_field):
            try:
                ids, mask = tokenize(record)
            except RecordError as e:
                bad(where, str(e))
                continue
            if ids:
                yield ids, mask

    def report(text: str) -> None:
        log.warning(text)
        if bad.report is not None:
            bad.report(text)

    return pack(examples(), cfg.seq_len, report)


def _split_stream(cfg: DataConfig, tokenize: Tokenize, bad: BadRecords, want: str):
    """Blocks of one side of the split, in data order; held-out blocks stop at max_held_out_blocks."""
    held = 0
    for i, block in enumerate(_blocks(cfg, tokenize, bad)):
        out = held < cfg.max_held_out_blocks and is_held_out(i, cfg.held_out_fraction)
        held += out
        if (want == "held_out") == out:
            yield block
        if want == "held_out" and held >= cfg.max_held_out_blocks:
            return


# -- datasets --------------------------------------------------------------------------------------
class Blocks:
    """Fixed-length training blocks in a reproducible order; `batch(position, ...)` is a pure function of position.

    In memory: every block is tokenized up front; epoch e visits them in the permutation drawn
    from seed + e. Streaming: blocks are read lazily through a seeded shuffle buffer, and a
    resumed run skips the blocks it already consumed (same order, re-read).
    """

    def __init__(self, cfg: DataConfig, tokenize: Tokenize, seed: int, bad: BadRecords):
        self.cfg = cfg
        self.tokenize = tokenize
        self.seed = seed
        self.bad = bad
        self._stream = None
        self._stream_pos = 0
        self._perm_epoch, self._perm_order = None, None
        if cfg.streaming:
            # Held-out blocks come from a first partial pass; training re-reads the stream lazily.
            held = list(_split_stream(cfg, tokenize, bad, "held_out"))
            self.held_out = _stack(held, cfg.seq_len)
            self.train = None
            self.num_train = None
            if next(iter(self._train_stream()), None) is None:
                raise DataError(f"{cfg.spec}: no training blocks: the data is too short for one sequence of {cfg.seq_len + 1} tokens beside the held-out share")
        else:
            held, train = [], []
            for i, block in enumerate(_blocks(cfg, tokenize, bad)):
                out = len(held) < cfg.max_held_out_blocks and is_held_out(i, cfg.held_out_fraction)
                (held if out else train).append(block)
            self.held_out = _stack(held, cfg.seq_len)
            if not train:
                raise DataError(
                    f"{cfg.spec}: no training blocks: the data holds {len(held)} held-out block(s) and none left "
                    f"for training at --seq-len {cfg.seq_len}; give more data, a shorter --seq-len, or a smaller --held-out"
                )
            self.train = _stack(train, cfg.seq_len)
            self.num_train = self.train[0].shape[0]

    # -- in memory --
    def _perm(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of the training blocks, drawn once per epoch (not per batch: a
        permutation of millions of blocks takes tens of milliseconds)."""
        if self._perm_epoch != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm_order, self._perm_epoch = torch.randperm(self.num_train, generator=gen), epoch
        return self._perm_order

    def _take_in_memory(self, start: int, count: int) -> list[int]:
        out, perms = [], {}
        for pos in range(start, start + count):
            epoch, i = divmod(pos, self.num_train)
            if epoch not in perms:
                perms[epoch] = self._perm(epoch)
            out.append(int(perms[epoch][i]))
        return out

    # -- streaming --
    def _train_stream(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Training blocks forever (epoch after epoch), shuffled through a seeded buffer."""
        epoch = 0
        while True:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            buf: list = []
            any_block = False
            for block in _split_stream(self.cfg, self.tokenize, self.bad, "train"):
                any_block = True
                buf.append(block)
                if len(buf) >= self.cfg.shuffle_buffer:
                    j = int(torch.randint(len(buf), (1,), generator=gen))
                    buf[j], buf[-1] = buf[-1], buf[j]
                    yield buf.pop()
            while buf:
                j = int(torch.randint(len(buf), (1,), generator=gen))
                buf[j], buf[-1] = buf[-1], buf[j]
                yield buf.pop()
            if not any_block:
                return
            epoch += 1

    def _take_streaming(self, start: int, count: int) -> list:
        if self._stream is None or self._stream_pos > start:
            self._stream, self._stream_pos = self._train_stream(), 0
        while self._stream_pos < start:  # a resumed run re-reads and drops what it already trained on
            next(self._stream)
            self._stream_pos += 1
        out = [next(self._stream) for _ in range(count)]
        self._stream_pos += count
        return out

    def batch_rows(self, position: int, batch_size: int, rank: int = 0, world: int = 1) -> list[int]:
        """The indices into the training blocks of this process's rows of the batch at `position` (in memory
        only): a block's stable key across epochs, as `batch` returns the same rows."""
        if self.cfg.streaming:
            raise ValueError("streamed blocks have no stable index")
        return self._take_in_memory(position, batch_size * world)[rank::world]

    def batch(self, position: int, batch_size: int, rank: int = 0, world: int = 1):
        """This process's rows of the global batch that starts at block `position`.

        Returns:
            ids (B, L+1) int64 and loss_mask (B, L) bool, and the position after the global batch.
        """
        count = batch_size * world
        if self.cfg.streaming:
            blocks = self._take_streaming(position, count)[rank::world]
            ids = torch.stack([b[0] for b in blocks])
            mask = torch.stack([b[1] for b in blocks])
        else:
            rows = self.batch_rows(position, batch_size, rank, world)
            ids, mask = self.train[0][rows], self.train[1][rows]
        return ids, mask, position + count


def _stack(blocks: list, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not blocks:
        return torch.empty(0, seq_len + 1, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.bool)
    return torch.stack([b[0] for b in blocks]), torch.stack([b[1] for b in blocks])


# -- eval prompts ---------------------------------------------------------------------------------------
def read_prompts(path: str, tokenizer, vocab_size: int, bad: BadRecords) -> list[list[int]]:
    """Prompts as token ids from a .jsonl (prompt / text / input_ids / messages) or .txt (one per line) file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: eval prompts file not found")
    prompts: list[list[int]] = []
    tokenize = Tokenize(tokenizer, vocab_size, "auto", "prompt")
    if _kind(p) == ".txt":
        with _open_binary(p) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:  # as the training data's .txt reader: named, and --on-bad-record applies
                    bad(f"{p}:{lineno}", "not valid UTF-8")
                    continue
                if line:
                    if tokenizer is None:
                        raise DataError(f"{p}: text prompts need a tokenizer; pass --tokenizer DIR")
                    prompts.append(tokenize._encode(line))
        return prompts
    for record, where in (_iter_jsonl(p, bad) if _kind(p) == ".jsonl" else _iter_json(p, bad)):
        try:
            if isinstance(record, dict) and ("messages" in record or "conversations" in record):
                if tokenizer is None:
                    raise DataError(f"{p}: chat prompts need a tokenizer; pass --tokenizer DIR")
                raw = record.get("messages", record.get("conversations"))
                msgs = [{"role": _SHAREGPT_ROLES.get(str(t.get("role", t.get("from"))).lower(), "user"),
                         "content": t.get("content", t.get("value"))} for t in raw]
                # The prompt is the conversation up to its first assistant turn.
                first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
                msgs = msgs[:first]
                prompts.append(tokenize._encode(tokenize._render(msgs, True)))
            elif isinstance(record, dict) and "text" in record and "prompt" not in record:
                if tokenizer is None:
                    raise DataError(f"{p}: text prompts need a tokenizer; pass --tokenizer DIR")
                prompts.append(tokenize._encode(record["text"]))
            else:
                ids, _ = tokenize(record)
                if ids and tokenize.eos is not None and ids[-1] == tokenize.eos and not isinstance(record.get("input_ids"), list):
                    ids = ids[:-1]  # a prompt continues; it does not end
                prompts.append(ids)
        except (RecordError, AttributeError, TypeError) as e:
            bad(where, f"not a usable prompt ({e})")
    return [q for q in prompts if q]
