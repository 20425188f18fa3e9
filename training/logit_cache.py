"""The target's top-K logits per training block, kept on disk (`ssmspec distill --cache-target-logits K`).

A frozen target gives the same logits for a training block every epoch, so with the cache its
forward runs once per block: the first time a block is drawn its top-K logits are written here,
and later epochs (and a resumed run) read them back. The loss then uses the sparse form
(`losses.topk_forward_kl`).

Two files in the output directory:

    target_topk.json   the header: format, k, vocab_size, seq_len, num_blocks, dtypes, the target's
                       fingerprint and weights digest, a digest of the training blocks
    target_topk.bin    values (N, L, K) float16 | ids (N, L, K) int32 | filled (N,) uint8,
                       each region starting on a 64-byte boundary (memory-mapped with numpy)

Values are the target's logits minus the position's largest logit (the top-K softmax does not
change; the largest values, which matter most, are the ones nearest 0, where float16 is finest),
clamped to float16's range. A block's `filled` byte is set after its values and ids are written,
so a run stopped anywhere leaves only whole blocks marked, and its resumption computes the rest.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ssmspec.errors import InputError

HEADER_FILE = "target_topk.json"
DATA_FILE = "target_topk.bin"
FORMAT = "ssmspec-target-topk/1"
_ALIGN = 64
_FP16_LOWEST = float(np.finfo(np.float16).min)
_SAMPLES = 256  # values read from each target tensor for its weights digest


def top_k_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float16, ids int32), each (..., k): the k largest logits, minus the largest, clamped to float16."""
    values, ids = logits.topk(k, dim=-1)  # in the logits' own dtype: no fp32 copy of the whole (B, L, V)
    values = values.float()
    values = (values - values[..., :1]).clamp_min(_FP16_LOWEST)
    return values.half(), ids.int()


def target_identity(target) -> dict:
    """The target's architecture fingerprint and a digest of its weights.

    `model_fingerprint` (the one profiles use) hashes the architecture only; another checkpoint of
    the same model would pass it, so a digest of a few evenly spaced values of every tensor is
    added (reading every weight of a large target would cost seconds at each start).
    """
    arch = None
    try:
        from ssmspec.models.loading import model_fingerprint

        arch = model_fingerprint(target)
    except Exception:  # not an ssmspec model (a transformers target): hash names, shapes and dtypes
        pass
    shapes = hashlib.sha256(type(target).__name__.encode())
    weights = hashlib.sha256()
    for name, t in sorted(target.state_dict().items()):
        shapes.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            picks = torch.linspace(0, flat.numel() - 1, min(_SAMPLES, flat.numel()), device=flat.device).long()
            weights.update(flat[picks].float().cpu().numpy().tobytes())
    return {"fingerprint": arch or shapes.hexdigest()[:16], "weights": weights.hexdigest()[:16]}


def data_digest(train_ids: torch.Tensor) -> str:
    """Digest of the training blocks' shape and up to 1024 evenly spaced blocks (block i must stay block i)."""
    h = hashlib.sha256(str(tuple(train_ids.shape)).encode())
    n = train_ids.shape[0]
    rows = torch.linspace(0, n - 1, min(1024, n)).long() if n else torch.empty(0, dtype=torch.long)
    h.update(train_ids[rows].to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class TargetLogitCache:
    """The memory-mapped cache of one run; `lookup` gives the top-K of a batch of blocks, computing the missing ones."""

    def __init__(self, out: Path, header: dict):
        self.header = header
        self.k, self.num_blocks, self.seq_len = header["k"], header["num_blocks"], header["seq_len"]
        n, L, k = self.num_blocks, self.seq_len, self.k
        path = Path(out) / DATA_FILE
        ids_at = _aligned(n * L * k * 2)
        filled_at = ids_at + _aligned(n * L * k * 4)
        self.values = np.memmap(path, np.float16, "r+", 0, (n, L, k))
        self.ids = np.memmap(path, np.int32, "r+", ids_at, (n, L, k))
        self.filled = np.memmap(path, np.uint8, "r+", filled_at, (n,))
        # This process's counts: blocks whose top-K came from the disk / from a target forward,
        # and target forward calls made / skipped because every block of the micro-batch was cached.
        self.stats = {"blocks_read": 0, "blocks_computed": 0, "target_calls": 0, "target_calls_saved": 0}

    @staticmethod
    def file_size(n: int, seq_len: int, k: int) -> int:
        return _aligned(n * seq_len * k * 2) + _aligned(n * seq_len * k * 4) + n

    @property
    def filled_blocks(self) -> int:
        return int(np.count_nonzero(self.filled))

    def lookup(self, rows: list[int], inputs: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K (values float16, ids int64), each (B, L, K) on inputs' device, of the blocks `rows` (B,).

        inputs (B, L) are those blocks' input ids; the target runs (in inference mode) on the rows
        not filled yet, and their top-K is written before being read back with the others, so a
        block's loss is the same whether its top-K was computed now or in an earlier epoch.
        """
        missing = [i for i, r in enumerate(rows) if not self.filled[r]]
        if missing:
            with torch.inference_mode():
                values, ids = top_k_logits(target(inputs[missing]), self.k)
            values, ids = values.cpu().numpy(), ids.cpu().numpy()
            for j, i in enumerate(missing):
                r = rows[i]
                self.values[r], self.ids[r] = values[j], ids[j]
                self.filled[r] = 1  # after the data: a block marked filled is whole
            self.stats["target_calls"] += 1
        else:
            self.stats["target_calls_saved"] += 1
        self.stats["blocks_computed"] += len(missing)
        self.stats["blocks_read"] += len(rows) - len(missing)
        index = np.asarray(rows)
        values = torch.from_numpy(np.ascontiguousarray(self.values[index]))
        ids = torch.from_numpy(np.ascontiguousarray(self.ids[index])).long()
        device = inputs.device
        if device.type == "cuda":
            return values.pin_memory().to(device, non_blocking=True), ids.pin_memory().to(device, non_blocking=True)
        return values.to(device), ids.to(device)

    def flush(self) -> None:
        for a in (self.values, self.ids, self.filled):
            a.flush()


def expected_header(k: int, target, train_ids: torch.Tensor, seq_len: int) -> dict:
    vocab = int(target.config.vocab_size)
    if k > vocab:
        raise InputError(f"--cache-target-logits {k} is more than the target's vocabulary ({vocab} tokens)")
    return {"format": FORMAT, "k": k, "vocab_size": vocab, "seq_len": seq_len, "num_blocks": int(train_ids.shape[0]),
            "values_dtype": "float16", "ids_dtype": "int32", "target": target_identity(target),
            "data": data_digest(train_ids)}


# What a mismatch of each header field means, for the one-line refusal.
_MEANING = {"format": "in another format", "k": "for another K", "vocab_size": "for another vocabulary",
            "target": "for another target", "seq_len": "for another --seq-len", "num_blocks": "for other training data",
            "data": "for other training data", "values_dtype": "in another format", "ids_dtype": "in another format"}


def check_header(found: dict, want: dict, path: Path) -> None:
    """Refuse a cache written for another target, K or data layout, naming the first difference."""
    for key, meaning in _MEANING.items():
        if found.get(key) != want[key]:
            raise InputError(f"--cache-target-logits: {path} was written {meaning} ({key} {found.get(key)!r}, this run "
                             f"{want[key]!r}); pass --overwrite to start the run over")


def prepare_cache(out: Path, header: dict, create: bool) -> bool:
    """Check the run's cache in `out` against `header` when it exists, else create it (when `create`:
    the main process; every process checks, so all refuse alike). Returns whether it existed.
    `TargetLogitCache(out, header)` maps it once it is there."""
    out = Path(out)
    head_path, data_path = out / HEADER_FILE, out / DATA_FILE
    size = TargetLogitCache.file_size(header["num_blocks"], header["seq_len"], header["k"])
    if head_path.exists():
        try:
            found = json.loads(head_path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"--cache-target-logits: {head_path} is unreadable ({e}); pass --overwrite to start over") from e
        check_header(found, header, head_path)
        if not data_path.exists() or data_path.stat().st_size != size:
            raise InputError(f"--cache-target-logits: {data_path} is missing or not {size} bytes long; "
                             "pass --overwrite to start over")
        return True
    if create:
        out.mkdir(parents=True, exist_ok=True)
        with open(data_path, "wb") as f:
            f.truncate(size)  # sparse where the filesystem allows: all zeros, no block filled
        # The header last: a header on disk means a data file of the right size beside it.
        tmp = head_path.with_name(f".{head_path.name}.tmp")
        tmp.write_text(json.dumps(header, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, head_path)
    return False
