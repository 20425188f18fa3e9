"""Drafters: propose a token tree rooted at the last produced token.

`ModelDrafter` runs any ssmspec model (a small Mamba-2 is the fast case) and drafts a tree by
batched state copies: the cache is branched once per node, so step d runs one batch row per
node of depth d (mamba-drafters paper, section 4.1). `NgramDrafter` needs no model: it looks
the context's last n-gram up in the context itself (prompt lookup decoding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ssmspec.trees import Tree

from ..models.lm import LanguageModel
from .sampling import SamplingParams, probabilities


@dataclass
class Draft:
    """A drafted tree: node 0 is the root (already produced), the rest are proposals."""

    tree: Tree
    tokens: list[int]
    q: torch.Tensor | None
    """(N, V) q[c] = the distribution node c was drawn from; None when drafted deterministically."""


class ModelDrafter:
    """Drafts with a model that shares the target's tokenizer.

    Its cache holds every produced token except those still `pending` (accepted by the last
    verification but not yet fed to the drafter); each `draft` feeds them first.
    """

    def __init__(self, model: LanguageModel, sample_children: bool = True):
        self.model = model
        self.sample_children = sample_children
        """At temperature > 0, draw children i.i.d. from the drafter (exact via multi-step
        speculative sampling); if False, take the top-k (exact via the naive rule)."""
        self.cache = None
        self.pending: list[int] = []
        self.steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, max_len: int) -> None:
        """Prefill on the prompt (1, T)."""
        self.cache = self.model.new_cache(1, max_len)
        self.model(prompt_ids.to(self.model.device), self.cache, last_only=True)
        self.pending = []

    def commit(self, accepted: list[int]) -> None:
        """Tokens the target accepted after the root (the root itself was fed while drafting)."""
        self.pending.extend(accepted)

    @torch.no_grad()
    def draft(self, root: int, shape: Tree, params: SamplingParams, generator) -> Draft:
        """Draft `shape` below `root`: each node gets as many children as it has in `shape`."""
        device = self.model.device
        feed = torch.tensor([self.pending + [root]], device=device)
        self.pending = []
        logits = self.model(feed, self.cache, last_only=True)[:, -1]  # (1, V)
        self.steps += 1
        depths = shape.depths
        levels: list[list[int]] = [[] for _ in range(shape.max_depth + 1)]
        for node, d in enumerate(depths):
            levels[d].append(node)
        tokens = [root] + [0] * shape.num_drafted
        deterministic = params.greedy or not self.sample_children
        q = None if deterministic else torch.zeros(shape.num_nodes, self.vocab_size, device=device)
        cache = self.cache
        for d in range(shape.max_depth):
            probs = probabilities(logits, params)  # (width_d, V) one row per node of depth d
            row_of = {node: r for r, node in enumerate(levels[d])}
            parent_rows = []
            rank_in_parent: dict[int, int] = {}
            for child in levels[d + 1]:
                parent = shape.parents[child]
                r = row_of[parent]
                parent_rows.append(r)
                rank_in_parent[parent] = rank_in_parent.get(parent, -1) + 1
                k = rank_in_parent[parent]
                if deterministic:
                    tokens[child] = int(torch.topk(probs[r] if not params.greedy else logits[r], k + 1).indices[k])
                else:
                    tokens[child] = int(torch.multinomial(probs[r].cpu(), 1, generator=generator))
                    q[child] = probs[r]
            if d + 1 == shape.max_depth:
                break
            # Branch the drafter's state: one row per child, copied from its parent's row.
            rows = torch.tensor(parent_rows, device=device)
            cache = cache.select(rows)
            step_tokens = torch.tensor([[tokens[c]] for c in levels[d + 1]], device=device)
            logits = self.model.step(step_tokens, cache)[:, -1]
            self.steps += 1
        return Draft(shape, tokens, q)


class NgramDrafter:
    """Prompt lookup: continue the context's last n-gram as it continued earlier in the context.

    Drafts are deterministic (verified with the naive rule). Distinct continuations of the
    matches fill the tree's branches, most recent match first, up to the given shape; with no
    match it drafts nothing and the step degenerates to plain decoding.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []
        self.steps = 0

    def begin(self, prompt_ids: torch.Tensor, max_len: int) -> None:
        self.history = [int(t) for t in prompt_ids[0].tolist()]

    def commit(self, accepted: list[int]) -> None:
        self.history.extend(accepted)

    def draft(self, root: int, shape: Tree, params: SamplingParams, generator) -> Draft:
        self.history.append(root)
        ctx = self.history
        depth = shape.max_depth
        widths = _max_children_per_depth(shape)
        continuations: list[list[int]] = []
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # most recent first
                if ctx[start:start + n] == suffix:
                    continuations.append(ctx[start + n:start + n + depth])
            if continuations:
                break
        parents, tokens = [-1], [root]
        child_of: dict[tuple[int, int], int] = {}
        for cont in continuations:
            node = 0
            for d, tok in enumerate(cont):
                key = (node, tok)
                if key not in child_of:
                    if sum(1 for (p, _) in child_of if p == node) >= widths[d]:
                        break
                    parents.append(node)
                    tokens.append(tok)
                    child_of[key] = len(tokens) - 1
                node = child_of[key]
        return Draft(Tree.from_parents(parents), tokens, None)


def _max_children_per_depth(shape: Tree) -> list[int]:
    """Largest fan-out used at each depth of the shape (the config level for config trees)."""
    counts: dict[int, int] = {}
    for p in shape.parents[1:]:
        counts[p] = counts.get(p, 0) + 1
    widths = [0] * shape.max_depth
    for node, c in counts.items():
        d = shape.depths[node]
        widths[d] = max(widths[d], c)
    return widths
