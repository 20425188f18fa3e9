"""CUDA-graph capture of the decode step and of one tree iteration (verify + accept + replay).

At batch 1 a decode step is a few hundred small launches; replaying them as one captured graph
removes the host from the loop. Everything that changes between iterations (the input tokens,
the accepted path and its length) lives in static device tensors that the graph reads, so a
whole speculative iteration runs with no host synchronisation; the caller reads back only the
produced tokens.

Capture needs every op of the captured region to avoid host syncs: use the Triton backend
(the plain-torch tree references build their masks on the host). Attention layers must have
their KV capacity allocated before capture (`new_cache(batch, max_len)` with max_len large enough).

Sampling (temperature > 0) takes the same graphs: every argmax the captured work takes (the
step's next token, greedy acceptance) is taken over `sampling.race_scores`, whose argmax is a
draw from the processed distribution; drafts with sampled children are accepted by
multi-step speculative sampling (ops/sampled_accept) instead. The noise
they read (Exp(1) draws, uniforms) lives in static buffers refilled eagerly before each replay
from the caller's generator: no RNG runs inside a captured graph.
"""
from __future__ import annotations

import torch

from ..models.cache import ModelCache
from ..models.lm import LanguageModel
from ..ops import dispatch, graph_tables
from .acceptance import children_table
from .sampling import SamplingParams, probabilities, race_noise_, race_scores

GREEDY = SamplingParams()


def _warm_up_and_capture(fn, cache: ModelCache, warmup: int = 2, also=()) -> torch.cuda.CUDAGraph:
    """Run fn a few times on a side stream (compiles kernels, sets up cuBLAS), restore the cache
    (and the caches or tensors in `also`), then capture fn. They hold the same values afterwards
    as before."""
    snapshot = cache.clone()
    kept = [(x, x.clone()) for x in also]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_tables.capture(graph):  # no table copies in the graph, no collection during it
        fn()
    cache.copy_(snapshot)  # capture itself runs nothing, but the warm-up steps advanced the cache
    for x, saved in kept:
        x.copy_(saved)
    torch.cuda.synchronize()
    return graph


def _run(graph, fn, cache: ModelCache) -> None:
    """Replay `graph`, or run `fn` eagerly where none was captured (the CPU, debugging)."""
    if graph is None:
        with torch.inference_mode():
            fn()
        return
    graph.replay()
    # the captured replay may have left pending inputs (models/cache.py): a later step must flush them first
    cache.pending_dirty = cache.pending_count is not None


class StepGraph:
    """`model.step` captured for one batch size and one cache.

    Usage: `g = StepGraph(model, cache)`; `logits = g(ids)` advances `cache` by one token and
    returns a static (B, 1, V) buffer that the next call overwrites. With sampling `params`
    (temperature > 0) the graph also draws the next token on the device: `g(ids, generator)`,
    then `g.drawn` (B, 1) holds a draw from the processed distribution of the new logits.
    """

    def __init__(self, model: LanguageModel, cache: ModelCache, params: SamplingParams = GREEDY,
                 capture: bool = True):
        self.model = model
        self.cache = cache
        device = cache.seqlen.device
        self.ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self.logits = self.drawn = None
        # greedy: the captured work is the step alone (the caller takes the argmax of the logits)
        self.noise = None if params.greedy else torch.ones(cache.batch_size, 1, model.config.vocab_size, device=device)

        def step():
            self.logits = model.step(self.ids, cache)
            if self.noise is not None:
                self.drawn = race_scores(self.logits, params, self.noise).argmax(-1)  # (B, 1)

        self._step = step
        self.graph = None
        if capture:  # capture=False runs the same step eagerly (CPU, debugging)
            with torch.inference_mode():
                self.graph = _warm_up_and_capture(step, cache)

    def __call__(self, ids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """ids (B, 1) -> logits (B, 1, V) (a static buffer); `generator` feeds the draw when sampling."""
        self.ids.copy_(ids)
        self._run(generator)
        return self.logits

    def advance(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """One step on the tokens in `ids`, which then hold the next tokens (the argmax of the new
        logits, or the draw when sampling), all on the device: steps chain without the host.
        Returns `ids` (B, 1), the static buffer the next call reads and overwrites."""
        self._run(generator)
        self.ids.copy_(self.logits.argmax(-1) if self.noise is None else self.drawn)
        return self.ids

    def _run(self, generator: torch.Generator | None) -> None:
        self.model.settle(self.cache)  # pending inputs of tree iterations into the states (not captured)
        if self.noise is not None:
            race_noise_(self.noise, generator)
        if self.graph is None:
            with torch.inference_mode():
                self._step()
        else:  # not graphs._run: a step leaves no pending inputs, so the cache stays clean after it
            self.graph.replay()


class GreedyTreeGraph:
    """One speculative iteration on a fixed tree with greedy acceptance, captured: verify, accept, replay.

    Greedy acceptance on the device: node i > 0 is accepted when its token equals the target's
    argmax at its parent; a node survives when every node on its path is accepted; the deepest
    surviving node (lowest packed index among equals) ends the accepted path, and the target's
    argmax there is the bonus token (the rule and its reference: ops/greedy_accept/naive.py; two
    Triton launches under the kernel backend). The path and its length go to `model.replay` as
    device tensors.

    Sampling (`params` with temperature > 0) keeps the walk and replaces the argmax at every node
    by an independent draw from the processed target distribution there (`race_scores`). That is
    the deterministic-draft rule (acceptance.accept_deterministic): at node u draw x ~ p_u, descend
    to the child carrying x, else x is the bonus. Drawing x at every node up front instead of along
    the walk changes nothing, since only the draws on the walked path are ever used. Exact for
    drafts that are a function of the context (top-k children, n-grams), not for sampled children.

    Sampled children (`draft_q`: the static (N, V) buffer where the draft keeps, per node, the
    drafter distribution its children were drawn from i.i.d.) take multi-step speculative
    sampling instead (ops/sampled_accept: acceptance.accept_sampled on the device, one launch on
    the kernels), with per-node-and-sibling uniforms and the bonus races as noise.

    Usage: `g = GreedyTreeGraph(model, cache, tree)`; `tokens, n = g(tree_tokens)` with
    tree_tokens (B, N) advances the cache over root + accepted nodes and returns the static
    buffers `tokens` (B, D+1) (accepted drafted tokens, the bonus, then 0s) and
    `n` (B,) = accepted drafted tokens + 1.
    """

    def __init__(self, model: LanguageModel, cache: ModelCache, tree, capture: bool = True,
                 params: SamplingParams = GREEDY, draft_q: torch.Tensor | None = None):
        if draft_q is not None and params.greedy:
            raise ValueError("a draft with sampled children (draft_q) needs sampling params (temperature > 0)")
        device = cache.seqlen.device
        self.model, self.cache, self.tree = model, cache, tree
        batch, n_nodes = cache.batch_size, tree.num_nodes
        depth_count = tree.max_depth + 1
        self.tokens_in = torch.zeros(batch, n_nodes, dtype=torch.long, device=device)
        self.parents = tree.parents_tensor(device)
        self.depth = tree.depth_tensor(device)
        self.mask = tree.mask_tensor(device)  # (N, N) ancestors
        # paths[i] = root-to-i node list, padded with 0 (replay never reads past path_len).
        paths = torch.zeros(n_nodes, depth_count, dtype=torch.long)
        for i in range(n_nodes):
            p = tree.path(i)
            paths[i, : len(p)] = torch.tensor(p)
        self.paths = paths.to(device)
        self.out_tokens = self.out_len = self.out_last = None  # out_last: (B,) deepest accepted node
        # greedy: the captured work is verify's raw logits into the acceptance, nothing more
        self.noise = None if params.greedy else torch.ones(batch, n_nodes, model.config.vocab_size, device=device)
        self.draft_q = draft_q
        if draft_q is not None:
            self.children = children_table(tree, device)  # (N, K)
            self.uniforms = torch.zeros(batch, n_nodes, self.children.shape[1], device=device)

        def iteration():
            # only argmaxes are taken: the logits may stay bf16 (no cast launch; the same argmax;
            # `probabilities` casts to fp32 when sampling)
            logits, acts = model.verify(self.tokens_in, tree, cache, float_logits=False)
            if self.draft_q is not None:
                path, path_len, out, last = dispatch.sampled_accept(
                    probabilities(logits, params), self.draft_q.expand(batch, -1, -1), self.tokens_in,
                    self.children, self.uniforms, self.noise, self.paths, self.depth)
            else:
                scores = logits if self.noise is None else race_scores(logits, params, self.noise)
                path, path_len, out, last = dispatch.greedy_accept(scores, self.tokens_in, self.parents, self.depth,
                                                                   self.mask, self.paths)
            model.replay(cache, acts, path, path_len)
            self.out_tokens, self.out_len, self.out_last = out, path_len, last

        self._iteration = iteration
        self.graph = None
        if capture:  # capture=False runs the same iteration eagerly (CPU, debugging)
            with torch.inference_mode():
                self.graph = _warm_up_and_capture(iteration, cache)

    def draw_noise(self, generator: torch.Generator | None) -> None:
        """Fresh noise for the next iteration's draws (eager; nothing to do when greedy)."""
        if self.noise is not None:
            race_noise_(self.noise, generator)
        if self.draft_q is not None:
            self.uniforms.uniform_(generator=generator)

    def __call__(self, tree_tokens: torch.Tensor, generator: torch.Generator | None = None):
        """tree_tokens (B, N) -> (tokens (B, D+1), n (B,)) static buffers; see the class docstring.
        `generator` feeds the draws when sampling."""
        self.tokens_in.copy_(tree_tokens)
        self.draw_noise(generator)
        _run(self.graph, self._iteration, self.cache)
        return self.out_tokens, self.out_len


class ChainPrefill:
    """A prompt run into a cache as chains of at most CHUNK tokens, each chain one replayed graph
    (verify + replay of the whole chain: the state of stepping the prompt token by token).

    A prompt of T tokens runs as T // CHUNK full chunks and the binary digits of the rest
    (32, 16, ..., 1), so any prompt length uses at most 7 chain sizes: each is compiled and
    captured once, and a prefill costs a few graph replays instead of hundreds of launches.
    """

    CHUNK = 64

    def __init__(self, model: LanguageModel, cache: ModelCache, capture: bool = True):
        # The prompt goes straight into the SSM states (the cache is fresh: no pending inputs): the
        # pending slots pay off for short accepted paths, not for chains of 64 (0.6 ms of a
        # 130-token prefill at the mamba2-130m shape on the H100 through them).
        cache = cache.without_pending()
        self.model, self.cache, self.capture = model, cache, capture
        self._chains: dict[int, tuple] = {}

    @classmethod
    def sizes(cls, length: int) -> list[int]:
        """Chain sizes covering `length` tokens in order: full chunks, then powers of two."""
        out = [cls.CHUNK] * (length // cls.CHUNK)
        rest = length % cls.CHUNK
        bit = cls.CHUNK // 2
        while rest:
            if rest >= bit:
                out.append(bit)
                rest -= bit
            bit //= 2
        return out

    def _chain(self, n: int):
        if n not in self._chains:
            from ssmspec.trees import Tree

            model, cache = self.model, self.cache
            tree = Tree.chain(n - 1)
            ids = torch.zeros(1, n, dtype=torch.long, device=cache.seqlen.device)
            path = torch.arange(n, device=ids.device)[None]
            path_len = torch.full((1,), n, device=ids.device)
            out = {}

            def run():
                logits, acts = model.verify(ids, tree, cache)
                model.replay(cache, acts, path, path_len)
                out["logits"] = logits[0, -1]

            graph = None
            if self.capture:
                with torch.inference_mode():
                    graph = _warm_up_and_capture(run, cache)
            self._chains[n] = (ids, graph, run, out)
        return self._chains[n]

    def __call__(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt (1, T) into the cache (advanced in place); returns the last token's logits (V,)."""
        start = 0
        logits = None
        for n in self.sizes(prompt.shape[1]):
            ids, graph, run, out = self._chain(n)
            ids.copy_(prompt[:, start:start + n])
            _run(graph, run, self.cache)
            logits = out["logits"]
            start += n
        return logits


class SpeculativeIterationGraph:
    """One whole speculative iteration, captured: the drafter's commit and draft (decoding/
    drafters.py FusedGreedyDraft), then the target's verify, acceptance and replay
    (GreedyTreeGraph), then the next root and commit row handed back to the drafter, all on
    the device. The host replays it and reads back the produced tokens once per iteration.
    Sampling (`params`, temperature > 0) with a top-k draft races the target's draws at every
    node (the naive rule); with a sampled draft (`draft.sampled`) the children are races over
    the drafter's q and the acceptance is multi-step speculative sampling (see GreedyTreeGraph).
    Both are exact.

    Usage: `g = SpeculativeIterationGraph(target, cache, draft)`; `draft.start(root)` after the
    prefills; then each `tokens, n, last = g()` advances both models over the accepted path.
    """

    def __init__(self, model: LanguageModel, cache: ModelCache, draft, capture: bool = True,
                 params: SamplingParams = GREEDY):
        self.draft, self.cache = draft, cache
        draft_q = draft.q if draft.sampled else None
        if draft_q is not None and draft.params != params:
            raise ValueError("a sampled draft must draw with the target's sampling params")
        self.verify = GreedyTreeGraph(model, cache, draft.shape, capture=False, params=params, draft_q=draft_q)
        verify = self.verify
        shared = cache.batch_size == 1
        if shared:  # the verify reads the draft's tokens in place: no copy launch
            verify.tokens_in = draft.tokens[None]

        def iteration():
            draft.run()
            if not shared:
                verify.tokens_in.copy_(draft.tokens[None])
            verify._iteration()
            draft.commit_row.copy_(verify.out_last)
            torch.gather(verify.out_tokens, 1, (verify.out_len - 1)[:, None], out=draft.root)

        self._iteration = iteration
        self.graph = None
        if capture:
            with torch.inference_mode():
                self.graph = _warm_up_and_capture(
                    iteration, cache, also=(draft.cache, draft.node_cache, draft.root, draft.commit_row))

    def __call__(self, generator: torch.Generator | None = None):
        """-> (tokens (1, D+1), n (1,), last (1,)) static buffers (see GreedyTreeGraph);
        `generator` feeds the draft's and the acceptance's draws when sampling."""
        self.draft.draw_noise(generator)
        self.verify.draw_noise(generator)
        _run(self.graph, self._iteration, self.cache)
        return self.verify.out_tokens, self.verify.out_len, self.verify.out_last
