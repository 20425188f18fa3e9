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
from ..ops import dispatch
from .sampling import SamplingParams, probabilities, race_noise_


@dataclass
class Draft:
    """A drafted tree: node 0 is the root (already produced), the rest are proposals."""

    tree: Tree
    tokens: torch.Tensor
    """(N,) int64 token of every node, on the drafter's device."""
    q: torch.Tensor | None
    """(N, V) q[c] = the distribution node c was drawn from; None when drafted deterministically."""

    def token_list(self) -> list[int]:
        return self.tokens.tolist()


@dataclass(frozen=True)
class _Level:
    """How the nodes of one depth hang below the previous depth's rows (built once per shape)."""

    nodes: torch.Tensor  # (W,) packed index of each node of this depth
    parent_rows: torch.Tensor  # (W,) row of its parent among the previous depth's nodes
    ranks: torch.Tensor  # (W,) its rank among its siblings (0 = best token)
    max_children: int


def _levels(shape: Tree, device) -> list[_Level]:
    by_depth: list[list[int]] = [[] for _ in range(shape.max_depth + 1)]
    for node, d in enumerate(shape.depths):
        by_depth[d].append(node)
    out = []
    for d in range(1, shape.max_depth + 1):
        row_of = {node: r for r, node in enumerate(by_depth[d - 1])}
        seen: dict[int, int] = {}
        rows, ranks = [], []
        for child in by_depth[d]:
            parent = shape.parents[child]
            rows.append(row_of[parent])
            ranks.append(seen.get(parent, 0))
            seen[parent] = ranks[-1] + 1
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        out.append(_Level(as_tensor(by_depth[d]), as_tensor(rows), as_tensor(ranks), max(seen.values())))
    return out


def _row_packed_cache(model, batch: int, max_len: int):
    """A drafter cache whose rows are copied and gathered whole (models/cache.py packed_mamba_rows:
    one launch per row copy for all Mamba layers), where the model offers that layout."""
    if isinstance(model, LanguageModel):
        return model.new_cache(batch, max_len, packed=True)
    return model.new_cache(batch, max_len)


@dataclass
class _Plan:
    """Everything a shape needs, built once: level wiring, per-depth state buffers, a graph."""

    levels: list[_Level]
    row_of: dict[int, int]  # node -> its row among the nodes of its depth
    caches: list  # caches[d]: the state after the nodes of depth d, one row each (d >= 1)
    graph: object = None  # captured greedy draft (CUDA), built on first use


class ModelDrafter:
    """Drafts with a model that shares the target's tokenizer.

    The drafter's state follows the produced text without recomputation: drafting already ran
    the drafter on every non-leaf node of the tree, one batch row per node (each row a copy of
    its parent's state), so after verification `commit` keeps the row of the deepest accepted
    node it has processed. At most two tokens (a fully accepted leaf, then the bonus token) are
    fed before the next draft. All states live in buffers allocated once per tree shape, so on
    a GPU a whole greedy draft is one replayed CUDA graph.
    """

    CAPACITY_BUCKET = 512
    """Attention capacity of the drafter's caches is allocated in multiples of this many tokens."""

    def __init__(self, model: LanguageModel, sample_children: bool = True, graphs: bool | None = None):
        self.model = model
        self.sample_children = sample_children
        """At temperature > 0, draw children i.i.d. from the drafter (exact via multi-step
        speculative sampling, on the host or, on the fast path, ops/sampled_accept);
        if False, take the top-k (exact via the naive rule). Sampled children are accepted far more
        often at high temperature: the naive rule accepts a child only when the target's own draw
        happens to be one of the top-k."""
        self.graphs = graphs
        """Capture greedy drafts as CUDA graphs; None = when the model is on CUDA."""
        self.cache = None
        self.pending: list[int] = []
        self.steps = 0
        self._plans: dict = {}
        self._last = None  # the plan of the last draft, for `commit`
        self._max_len = 0
        # (tree parents, sampling params of sampled children or None) -> FusedGreedyDraft (tied to the cache, the buffers)
        self._fused: dict = {}
        self._fused_buffers = None  # FusedDraftBuffers shared by the fused drafts
        self._prefill = None  # ChainPrefill on the cache (tied to it)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def _use_graphs(self) -> bool:
        return self.graphs if self.graphs is not None else self.model.device.type == "cuda"

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, max_len: int) -> None:
        """Prefill on the prompt (1, T)."""
        if self.cache is None or max_len > self._max_len:
            # Capacity in buckets, so that a slightly longer request keeps the captured graphs.
            self._max_len = -(-max_len // self.CAPACITY_BUCKET) * self.CAPACITY_BUCKET
            self.cache = _row_packed_cache(self.model, 1, self._max_len)
            # buffers and graphs are tied to the cache
            self._plans, self._fused, self._fused_buffers, self._prefill = {}, {}, None, None
        else:
            self.cache.reset_()
        prompt_ids = prompt_ids.to(self.model.device)
        if self._use_graphs and dispatch.uses_kernel("tree_scan", self.model.device):
            if self._prefill is None:  # the prompt as a few replayed chain graphs, not hundreds of launches
                from .graphs import ChainPrefill

                self._prefill = ChainPrefill(self.model, self.cache, capture=self.model.device.type == "cuda")
            self._prefill(prompt_ids)
        else:
            self.model(prompt_ids, self.cache, last_only=True)
        self.pending = []
        self._last = None

    def fused_draft(self, shape: Tree, params: SamplingParams | None = None) -> "FusedGreedyDraft | None":
        """The device-side draft of `shape` (see FusedGreedyDraft) for sampling `params` (None:
        greedy), or None where the shape cannot be drafted that way; built once per shape,
        setting and cache. Its children are sampled when `params` samples and `sample_children`
        is on, the top-k otherwise."""
        if not FusedGreedyDraft.supports(shape) or self.cache is None:
            return None
        sampled = params if params is not None and not params.greedy and self.sample_children else None
        key = (shape.parents, sampled)
        if sampled is not None and any(k[1] not in (None, sampled) for k in self._fused):
            # one sampling setting at a time (its q and noise buffers), as the fast path keeps its graphs
            self._fused = {k: d for k, d in self._fused.items() if k[1] is None}
        if key not in self._fused:
            if self._fused_buffers is None or self._fused_buffers.capacity < shape.num_nodes:
                # Every tree drafts in one set of buffers (sized for the largest), so that a bandit
                # switching trees hands nothing over; a larger tree starts a new set (and new drafts).
                largest = max([shape.num_nodes] + [d.shape.num_nodes for d in self._fused.values()])
                self._fused_buffers = FusedDraftBuffers(self, largest)
                self._fused = {}
            self._fused[key] = FusedGreedyDraft(self, shape, self._fused_buffers, params=sampled)
        return self._fused[key]

    def start_from(self, cache) -> None:
        """Continue from an existing committed cache (batch 1) instead of a prompt (profiling)."""
        capacities = [c.keys.shape[2] for c in cache.layers if hasattr(c, "keys")]
        self.cache = cache
        self._max_len = max(capacities) if capacities else int(cache.seqlen.max()) + 1
        self._plans, self.pending, self._last = {}, [], None
        self._fused, self._fused_buffers, self._prefill = {}, None, None

    def commit(self, accepted: list[int], path: list[int] | None = None) -> None:
        """The target accepted `accepted` (tokens of `path[1:]`, path = tree nodes from the root).

        With the path, the state of the deepest accepted node the drafter ran on is kept and
        only the rest is left to feed; without it, all accepted tokens are fed again.
        """
        if path is None or self._last is None:
            self.pending.extend(accepted)
            return
        plan, self._last = self._last, None
        processed = min(len(path) - 1, len(plan.caches))  # deepest accepted depth that was run
        if processed > 0:
            row = torch.tensor([plan.row_of[path[processed]]], device=self.model.device)
            self.cache.gather_(plan.caches[processed - 1], row)
        self.pending.extend(accepted[processed:])

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Advance the committed state over `tokens`; returns the last token's logits (1, V)."""
        device = self.model.device
        self.steps += 1
        if len(tokens) <= 2:  # the usual case: single-token steps (fused kernels)
            for tok in tokens:
                logits = self.model.step(torch.tensor([[tok]], device=device), self.cache)
            return logits[:, -1]
        return self.model(torch.tensor([tokens], device=device), self.cache, last_only=True)[:, -1]

    def _plan(self, shape: Tree) -> _Plan:
        device = self.model.device
        key = (shape.parents, str(device))
        if key not in self._plans:
            levels = _levels(shape, device)
            row_of = {0: 0}
            for level in levels:
                row_of.update({int(n): r for r, n in enumerate(level.nodes.tolist())})
            # Depths 1 .. g-1 are run (the deepest level's nodes are leaves, never fed).
            caches = [_row_packed_cache(self.model, len(level.nodes), self._max_len) for level in levels[:-1]]
            self._plans[key] = _Plan(levels, row_of, caches)
        return self._plans[key]

    def _expand(self, logits, plan: _Plan, tokens, params: SamplingParams, generator, q):
        """Fill tokens[1:] level by level from the root's logits (1, V); q for sampled children."""
        deterministic = q is None
        cache = self.cache
        for d, level in enumerate(plan.levels):
            if deterministic:
                scores = logits if params.greedy else probabilities(logits, params)
                chosen = dispatch.ranked_tokens(scores, level.parent_rows, level.ranks)
            else:
                probs = probabilities(logits, params)[level.parent_rows]  # (W, V): i.i.d. per child
                chosen = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(tokens.device)
                q[level.nodes] = probs
            tokens[level.nodes] = chosen
            if d + 1 == len(plan.levels):
                break
            # Branch the state: each node's row is a copy of its parent's row.
            nxt = plan.caches[d]
            nxt.gather_(cache, level.parent_rows)
            logits = self.model.step(chosen[:, None], nxt)[:, -1]
            cache = nxt
        return tokens

    @torch.no_grad()
    def draft(self, root: int, shape: Tree, params: SamplingParams, generator) -> Draft:
        """Draft `shape` below `root`: each node gets as many children as it has in `shape`."""
        device = self.model.device
        plan = self._plan(shape)
        self._last = plan
        deterministic = params.greedy or not self.sample_children
        if params.greedy and self._use_graphs and shape.max_depth > 0:
            if self.pending:
                self._feed(self.pending)
            self.pending = []
            self.steps += shape.max_depth
            return Draft(shape, self._graphed_draft(plan, shape, root).clone(), None)
        logits = self._feed(self.pending + [root])  # (1, V): the root's row
        self.pending = []
        self.steps += max(shape.max_depth - 1, 0)
        tokens = torch.empty(shape.num_nodes, dtype=torch.long, device=device)
        tokens[0] = root
        q = None if deterministic else torch.zeros(shape.num_nodes, self.vocab_size, device=device)
        self._expand(logits, plan, tokens, params, generator, q)
        return Draft(shape, tokens, q)

    def _graphed_draft(self, plan: _Plan, shape: Tree, root: int) -> torch.Tensor:
        """Root step + every level as one captured graph (greedy only); returns its static tokens."""
        if plan.graph is None:
            plan.graph = _DraftGraph(self, plan, shape)
        return plan.graph(root)


class _DraftGraph:
    """A greedy draft from the committed state as one replayed CUDA graph (eager on the CPU)."""

    def __init__(self, drafter: ModelDrafter, plan: _Plan, shape: Tree):
        model = drafter.model
        device = model.device
        self.root = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(shape.num_nodes, dtype=torch.long, device=device)
        greedy = SamplingParams()

        def run():
            logits = model.step(self.root, drafter.cache)[:, -1]
            self.tokens[0] = self.root[0, 0]
            drafter._expand(logits, plan, self.tokens, greedy, None, None)

        self.run = run
        self.graph = None
        if device.type == "cuda":
            from .graphs import _warm_up_and_capture

            with torch.inference_mode():
                self.graph = _warm_up_and_capture(run, drafter.cache)

    def __call__(self, root: int) -> torch.Tensor:
        self.root.fill_(root)
        if self.graph is None:
            self.run()
        else:
            self.graph.replay()
        return self.tokens


class FusedDraftBuffers:
    """The device state every FusedGreedyDraft of one drafter shares: the per-node states of the
    last draft (`node_cache`, `capacity` rows), the drafted tokens, the next root token and the
    row to commit. Since each draft reads the row its predecessor's iteration named, whatever tree
    that was, a policy may switch trees between iterations with no copy at all."""

    def __init__(self, drafter: "ModelDrafter", capacity: int):
        device = drafter.model.device
        self.capacity = capacity
        self.node_cache = _row_packed_cache(drafter.model, capacity, drafter._max_len)
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)  # a draft's tokens: its first N
        self.root = self.tokens[:1].view(1, 1)  # node 0's token: the next root is written in place (no copy)
        self.commit_row = torch.zeros(1, dtype=torch.long, device=device)


class FusedGreedyDraft:
    """A draft of one tree shape whose inputs and outputs stay on the device: top-k children
    (greedy, or the naive rule at temperature > 0), or children sampled from the drafter.

    The drafter keeps its state after every node of the last draft, one cache row per node
    (`node_cache`; nodes of one depth are contiguous in packed order, so each depth is a view
    of it). Committing the accepted path is then a copy of one row, chosen by a device index
    (`commit_row`, the deepest accepted node), and the next root token is a device tensor too
    (`root`): draft -> verify -> commit runs with no host work, so the whole speculative
    iteration can be one CUDA graph (decoding/graphs.py SpeculativeIterationGraph). The deepest
    level is stepped as well (one batched drafter step more than `ModelDrafter.draft`), so that
    every node has its state and no accepted token is left to feed.

    With sampling `params`, each node's children are drawn i.i.d. from its processed drafter
    distribution q (`probabilities`, the target's SamplingParams) by exponential races over a
    noise buffer that `draw_noise` refills eagerly before each run (no RNG inside a graph), and
    `q` (N, V) keeps every non-leaf node's q for the acceptance (ops/sampled_accept).
    """

    def __init__(self, drafter: "ModelDrafter", shape: Tree, buffers: FusedDraftBuffers | None = None,
                 params: SamplingParams | None = None):
        if not self.supports(shape):
            raise ValueError(f"tree {shape.spec()} cannot be drafted on the device (needs depth-ordered nodes)")
        model = drafter.model
        device = model.device
        self.drafter, self.shape = drafter, shape
        self.levels = _levels(shape, device)
        self.buffers = buffers or FusedDraftBuffers(drafter, shape.num_nodes)
        if self.buffers.capacity < shape.num_nodes:
            raise ValueError(f"tree {shape.spec()} has {shape.num_nodes} nodes; the buffers hold {self.buffers.capacity}")
        self.node_cache = self.buffers.node_cache
        starts = [int(level.nodes[0]) for level in self.levels]
        self.level_rows = [self.node_cache.rows(start, len(level.nodes)) for start, level in zip(starts, self.levels)]
        # The rows before each level: its parents' states (disjoint from the level's own rows).
        self.above_rows = [self.node_cache.rows(0, start) for start in starts]
        self.parent_nodes = [torch.tensor([shape.parents[int(n)] for n in level.nodes.tolist()], device=device)
                             for level in self.levels]
        self.root, self.commit_row = self.buffers.root, self.buffers.commit_row
        self.tokens = self.buffers.tokens[:shape.num_nodes]  # tokens[0] is `root`
        # Each level's tokens as a view of `tokens` (its nodes are contiguous): the child picks write there.
        self.level_tokens = [self.tokens[start:start + len(level.nodes)] for start, level in zip(starts, self.levels)]
        self.cache = drafter.cache  # the committed state this draft continues (captured by pointer)
        self.params = params if params is not None and not params.greedy else None
        self.q = self.child_noise = None
        if self.params is not None:
            vocab = model.config.vocab_size
            self.q = torch.zeros(shape.num_nodes, vocab, device=device)  # q[u]: u's children's law (leaves: unused)
            self.child_noise = torch.ones(shape.num_nodes, vocab, device=device)  # row c: node c's race
            # Level i's parents are the nodes of depth i, contiguous: rows [start of depth i, start of level i).
            parent_starts = [0] + starts[:-1]
            self.level_q = [self.q[a:b] for a, b in zip(parent_starts, starts)]
            self.level_noise = [self.child_noise[start:start + len(level.nodes)]
                                for start, level in zip(starts, self.levels)]

    @property
    def sampled(self) -> bool:
        """Children drawn from the drafter (accepted by speculative sampling), not the top-k."""
        return self.params is not None

    def draw_noise(self, generator: torch.Generator | None) -> None:
        """Fresh Exp(1) noise for the next run's child draws (eager; nothing to do for top-k drafts)."""
        if self.child_noise is not None:
            race_noise_(self.child_noise, generator)

    @staticmethod
    def supports(shape: Tree) -> bool:
        depths = shape.depths
        return shape.max_depth > 0 and all(a <= b for a, b in zip(depths, depths[1:]))

    def start(self, root: int) -> None:
        """Continue from the drafter's committed state (after `begin`) with `root` next."""
        self.node_cache.rows(0, 1).copy_(self.cache)
        self.commit_row.zero_()
        self.root.fill_(root)

    def hand_over(self, other: "FusedGreedyDraft") -> None:
        """Continue with `other`'s tree from where this draft's last iteration left off: commit
        this draft's row into the drafter's state, and give `other` the next root (nothing to do
        where both draft in the same buffers, as a ModelDrafter's drafts do)."""
        if other.buffers is self.buffers:
            return
        self.cache.gather_(self.node_cache, self.commit_row)
        other.node_cache.rows(0, 1).copy_(self.cache)
        other.commit_row.zero_()
        other.root.copy_(self.root)

    def run(self) -> None:
        """Commit row `commit_row`, step `root`, draft every level into `tokens` (capturable)."""
        logits = self.step_root()
        for i in range(len(self.levels)):
            logits = self.draft_level(i, logits)

    def step_root(self) -> torch.Tensor:
        """The fixed part of a draft: commit row `commit_row` into the drafter's state, step `root`.

        Returns:
            the root's logits (1, V).
        """
        self.cache.gather_(self.node_cache, self.commit_row)
        # The logits only feed the child picks (which read bf16) or `probabilities` (which casts):
        # they may stay in the LM head's dtype, one cast launch fewer per drafter step.
        logits = self.drafter.model.step(self.root, self.cache, float_logits=False)[:, -1]
        self.node_cache.rows(0, 1).copy_(self.cache)
        return logits

    def draft_level(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        """Level i + 1 (depth i + 1, W nodes) below the W_prev nodes of depth i: pick its tokens
        from their logits (top-k, or i.i.d. draws when sampling), start each node's row as its
        parent's state, step them.

        Args:
            logits: (W_prev, V) logits of depth i's nodes (the root's for i = 0).
        Returns:
            (W, V) logits of this level's nodes.
        """
        level, rows = self.levels[i], self.level_rows[i]
        chosen = self.level_tokens[i]
        if self.params is None:
            dispatch.ranked_tokens(logits, level.parent_rows, level.ranks, out=chosen)  # one launch, into `tokens`
        else:
            self.level_q[i].copy_(probabilities(logits, self.params))  # (W_prev, V)
            # each child its own race (sampling.race_scores) over its parent's q: i.i.d. siblings; one launch
            dispatch.race_tokens(self.level_q[i], level.parent_rows, self.level_noise[i], out=chosen)
        rows.gather_(self.above_rows[i], self.parent_nodes[i])  # each node's row starts as its parent's state
        return self.drafter.model.step(chosen[:, None], rows, float_logits=False)[:, -1]


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

    def commit(self, accepted: list[int], path: list[int] | None = None) -> None:
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
        return Draft(Tree.from_parents(parents), torch.tensor(tokens, dtype=torch.long), None)


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
