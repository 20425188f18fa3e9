"""Limits checked before a generation starts: the model's context, the tree's width, the memory it needs.

The memory estimate counts what a generation allocates beyond the weights (already loaded when
it is checked): the caches of the target and the drafter, and the largest transient of the
prefill or of a tree verification. It follows the reference (plain-torch) paths, which hold the
most; on a GPU with the kernels the prefill runs in chunks of a few dozen tokens and holds less.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, ResourceError
from .models.attention import ATTENTION_SCORE_ELEMENTS
from .models.config import ModelConfig

ROPE_EXACT_POSITIONS = 1 << 24
"""RoPE angles are computed from fp32 positions, which are exact integers only up to 2**24:
past it two positions share one angle, so a model with rotary attention cannot go further."""
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
"""config.json keys that declare the context a model with attention was trained for."""
FP32 = 4
GIB = 2**30


# -----------------------------------------------------------------------------------------------
# context
# -----------------------------------------------------------------------------------------------
def declared_context(model_dir: str | Path | None) -> int | None:
    """The context a model directory's config.json declares (max_position_embeddings or the like), or None."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading has already read it; a model built in memory has none
    for key in CONTEXT_KEYS:
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def context_limit(cfg: ModelConfig, declared: int | None = None) -> tuple[int | None, str]:
    """The most positions (prompt + generated) the model can attend over, and where that comes from.

    Pure Mamba-2 (no attention) has no limit beyond memory: (None, ""). With attention, the
    declared context (config.json) when there is one, else RoPE's exact-position limit.
    """
    if "attention" not in cfg.layers:
        return None, ""
    if declared is not None:
        return declared, f"the model's config.json declares a context of {declared} positions"
    if cfg.attention.rotary_dim:
        return ROPE_EXACT_POSITIONS, f"rotary positions are exact up to {ROPE_EXACT_POSITIONS} (fp32)"
    return None, ""


def check_context(cfg: ModelConfig, prompt_tokens: int, max_new_tokens: int, tree_nodes: int = 0,
                  declared: int | None = None) -> None:
    """Refuse a prompt plus new tokens (plus one tree) longer than the model's context."""
    limit, why = context_limit(cfg, declared)
    needed = prompt_tokens + max_new_tokens + tree_nodes
    if limit is not None and needed > limit:
        tree_part = f" + {tree_nodes} tree nodes" if tree_nodes else ""
        raise InputError(
            f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens}{tree_part} need {needed} "
            f"positions but {why}; shorten the prompt or lower --max-new-tokens"
        )


def check_tree_width(tree, vocab_size: int) -> None:
    """Refuse a tree whose nodes need more distinct children than the vocabulary has tokens."""
    if tree is None:
        return
    widest = max((len(children) for children in tree.child_lists()), default=0)
    if widest > vocab_size:
        raise InputError(
            f"tree {tree.spec()} needs up to {widest} children per node but the vocabulary has {vocab_size} "
            f"tokens; use a tree with at most {vocab_size} children per node"
        )


# -----------------------------------------------------------------------------------------------
# memory
# -----------------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    caches: int
    """Bytes of the target's and drafter's caches."""
    activations: int
    """Bytes of the largest transient: the prefill's activations or a tree verification's."""
    positions: int
    """Positions each attention cache holds."""

    @property
    def total(self) -> int:
        return self.caches + self.activations


def cache_bytes(cfg: ModelConfig, rows: int, max_len: int, itemsize: int, pending: int = 0) -> int:
    """Bytes of `LanguageModel.new_cache(rows, max_len, pending=pending)`: keys and values per
    attention layer, conv and fp32 SSM states (and pending inputs) per Mamba layer."""
    a, m = cfg.attention, cfg.mamba
    attention = 2 * a.n_kv_heads * max_len * a.head_dim * itemsize
    mamba = m.conv_dim * (m.conv_kernel - 1) * itemsize + m.n_heads * m.head_dim * m.d_state * FP32
    mamba += pending * (m.n_heads * m.head_dim * itemsize + m.n_heads * FP32 + m.n_groups * m.d_state * itemsize)
    per = {"attention": attention, "mamba": mamba, "mlp": 0, "moe": 0}
    return rows * sum(per[kind] for kind in cfg.layers)


def prefill_bytes(cfg: ModelConfig, tokens: int, itemsize: int, cached: int = 0) -> int:
    """Peak transient bytes of a full-sequence pass over `tokens` tokens after `cached` cached ones.

    The residual stream lives throughout; the sublayers run one at a time, so the largest one
    counts. Mamba: the projections, the conv and the chunked scan's fp32 intermediates (its
    per-chunk decay and score blocks dominate). Attention: q/k/v, keys and values repeated to
    every head, and one chunk of scores (models/attention.py bounds it).
    """
    a, m, d = cfg.attention, cfg.mamba, cfg.d_model
    keys = cached + tokens
    stream = 3 * tokens * d * itemsize  # h, the normed input, the sublayer's output
    per_token = {
        "mamba": (2 * m.d_inner + 2 * m.n_groups * m.d_state + m.n_heads + 3 * m.conv_dim) * itemsize
        + (4 * m.n_heads * m.chunk_size + 2 * m.n_heads * m.d_state + 6 * m.d_inner
           + 2 * m.n_heads * m.head_dim * m.d_state // m.chunk_size + 3 * m.d_inner) * FP32,
        "attention": 3 * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * itemsize,
        "mlp": (3 if cfg.mlp.gated else 2) * cfg.mlp.d_intermediate * itemsize,
        # the routed experts' hidden rows (top_k per token) and the shared expert's
        "moe": (3 * cfg.moe.top_k * cfg.moe.d_intermediate + 3 * cfg.moe.shared_intermediate + cfg.moe.n_experts)
        * itemsize,
    }
    largest = max(per_token[kind] * tokens for kind in cfg.layers)
    if "attention" in cfg.layers:
        repeated = 2 * keys * a.n_heads * a.head_dim * itemsize
        scores = 2 * min(ATTENTION_SCORE_ELEMENTS, a.n_heads * tokens * keys) * FP32  # scores and their softmax
        largest = max(largest, per_token["attention"] * tokens + repeated + scores)
    return stream + largest + cfg.vocab_size * FP32


def verify_bytes(cfg: ModelConfig, nodes: int, cached: int, itemsize: int) -> int:
    """Peak transient bytes of one tree verification of `nodes` nodes after `cached` positions:
    the new activations, every node's logits, and per attention layer the keys and values
    concatenated and repeated to every head, with the scores over them."""
    a = cfg.attention
    total = prefill_bytes(cfg, nodes, itemsize) + nodes * cfg.vocab_size * FP32
    if "attention" in cfg.layers:
        keys = cached + nodes
        total += 2 * keys * (a.n_kv_heads + a.n_heads) * a.head_dim * itemsize + a.n_heads * nodes * keys * FP32
    return total


def estimate_generation(target_cfg: ModelConfig, prompt_tokens: int, max_len: int, itemsize: int,
                        drafter_cfg: ModelConfig | None = None, drafter_itemsize: int | None = None,
                        tree_nodes: int = 0, prefill_tokens: int | None = None) -> MemoryEstimate:
    """Memory a generation needs beyond the weights.

    Args:
        prompt_tokens: T, the prompt's length; max_len: positions each attention cache holds.
        drafter_cfg: the drafting model's config (None for prompt lookup or plain decoding); its
            caches hold one committed row plus one row per tree node.
        tree_nodes: N, nodes of the verified tree (0 for plain decoding).
        prefill_tokens: tokens the prefill runs at once (default all T).
    """
    at_once = prompt_tokens if prefill_tokens is None else min(prefill_tokens, prompt_tokens)
    caches = cache_bytes(target_cfg, 1, max_len, itemsize)
    transient = max(prefill_bytes(target_cfg, at_once, itemsize, cached=prompt_tokens - at_once),
                    verify_bytes(target_cfg, max(tree_nodes, 1), max_len, itemsize))
    if drafter_cfg is not None:
        d_item = drafter_itemsize or itemsize
        caches += cache_bytes(drafter_cfg, 1 + tree_nodes, max_len, d_item)
        transient = max(transient, prefill_bytes(drafter_cfg, prompt_tokens, d_item))
    return MemoryEstimate(caches, transient, max_len)


def available_bytes(device) -> tuple[int | None, str]:
    """(free bytes, what they are) on `device`: CUDA free plus this process's reusable cached
    blocks; CPU MemAvailable (/proc/meminfo), capped by the cgroup's limit. None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # One read of the allocator's counters: memory_reserved and memory_allocated each flatten
        # the whole statistics tree (0.25 ms per generation under cProfile on the H100).
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        cached = (stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
                  - stats.get("allocated_bytes", {}).get("all", {}).get("current", 0))
        return free + cached, f"{device} has"
    if device.type != "cpu":
        return None, ""
    free = _meminfo_available()
    limit = _cgroup_room()
    if limit is not None and (free is None or limit < free):
        return limit, "the memory limit of this container leaves"
    return free, "the machine has"


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Per cgroup version (v2, then v1): the memory limit, the usage, and memory.stat with the page
# cache the kernel reclaims before it kills (read weights files sit there, counted as usage).
CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
)
NO_CGROUP_LIMIT = 1 << 62
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _cgroup_room() -> int | None:
    """A cgroup memory limit minus what the group uses now (less its reclaimable page cache), or
    None where there is none. cgroup v1 too: Docker on older hosts limits memory there, and
    MemAvailable shows the whole host's."""
    for limit_file, usage_file, stat_file, cache_key in CGROUP_MEMORY_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
        except OSError:
            continue
        try:
            if limit == "max" or int(limit) >= NO_CGROUP_LIMIT:
                return None
            used = int(Path(usage_file).read_text())
        except (OSError, ValueError):
            return None
        return max(int(limit) - used + _stat_value(stat_file, cache_key), 0)
    return None


def _stat_value(stat_file: str, key: str) -> int:
    """One "key value" line of a cgroup memory.stat, 0 where it cannot be read."""
    try:
        for line in Path(stat_file).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def check_memory(estimate: MemoryEstimate, device) -> None:
    """Refuse a generation whose caches and activations exceed the device's free memory."""
    free, where = available_bytes(device)
    if free is None or estimate.total <= free:
        return
    raise ResourceError(
        f"this generation needs about {_gib(estimate.total)} (caches {_gib(estimate.caches)} for "
        f"{estimate.positions} positions, activations {_gib(estimate.activations)}) but {where} "
        f"{_gib(free)} available; shorten the prompt, lower --max-new-tokens, or use a smaller tree or model"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.0f} GiB"


# -----------------------------------------------------------------------------------------------
# the check `generate` runs first
# -----------------------------------------------------------------------------------------------
def check_generation(target, prompt_tokens: int, config, drafter=None, declared: int | None = None,
                     prefill_chunk: int | None = None) -> None:
    """Everything a generation can be refused for before it starts, cheapest first: the tree's
    width against the vocabulary, the length against the context, the memory against the device.

    Args:
        target: the LanguageModel; config: its GenerationConfig; drafter: a ModelDrafter,
            NgramDrafter or None; declared: the context of the model's config.json, if known;
            prefill_chunk: tokens the prefill runs at once where it goes by chunks (None: all).
    """
    cfg = target.config
    tree = config.tree if config.method != "ar" else None
    nodes = tree.num_nodes if tree is not None else 0
    check_tree_width(tree, cfg.vocab_size)
    check_context(cfg, prompt_tokens, config.max_new_tokens, nodes, declared)
    max_len = prompt_tokens + config.max_new_tokens + max(nodes, 1) + 1
    # Attention caches on the graph path are allocated in buckets of 512 positions.
    max_len = math.ceil(max_len / 512) * 512 if "attention" in cfg.layers else max_len
    drafter_model = getattr(drafter, "model", None) if tree is not None else None
    by_chunks = prefill_chunk
    estimate = estimate_generation(
        cfg, prompt_tokens, max_len, target.dtype.itemsize,
        drafter_cfg=None if drafter_model is None else drafter_model.config,
        drafter_itemsize=None if drafter_model is None else drafter_model.dtype.itemsize,
        tree_nodes=nodes, prefill_tokens=by_chunks,
    )
    check_memory(estimate, target.device)

