"""The decode loop: prefill, then draft_tree -> verify_tree -> accept_path -> replay_state.

One loop serves three methods: `ar` (one target step per token, the baseline), `chain` (a
drafted line verified in one call) and `stree` (a drafted tree packed and verified in one call).
`generate` runs it once and leaves the model as it found it; decoding/engine.py's `Engine` runs
it repeatedly on models it prepared, keeping its buffers and graphs between calls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ssmspec.trees import Tree, TreeArms

from ..errors import InputError
from ..limits import check_generation
from ..models.lm import LanguageModel
from ..ops import dispatch
from .acceptance import accept_deterministic, accept_greedy, accept_sampled
from .drafters import Draft, ModelDrafter
from .graphs import ChainPrefill, GreedyTreeGraph, SpeculativeIterationGraph, StepGraph
from .sampling import SamplingParams, is_integer, probabilities, race_noise_, race_scores, sample

METHODS = ("ar", "chain", "stree")
DEFAULT_STREE = (3, 2, 1, 1)
DEFAULT_CHAIN = 4


def _all_of(values, check) -> bool:
    """Whether `values` is a list-like whose every item passes `check` (a str or a tensor is not one)."""
    if isinstance(values, (str, bytes, torch.Tensor)):
        return False
    try:
        return all(check(v) for v in values)
    except TypeError:  # not iterable
        return False


@dataclass
class GenerationConfig:
    """Everything that shapes one generation; each default lives here only."""

    method: str = "stree"
    """ar, chain or stree."""
    tree: Tree | None = None
    """Draft tree shape; None = chain of 4 for `chain`, (3, 2, 1, 1) for `stree`."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    eos_token_id: int | Sequence[int] | None = None
    stop_strings: Sequence[str] = ()
    graphs: bool | None = None
    """Run the target's decode calls as replayed CUDA graphs, acceptance on the device.
    None = when the target is on CUDA. On the CPU, True runs the same device-side iteration
    eagerly (it is how the graph path is tested without a GPU). When sampling, this path draws
    from a device generator seeded with `seed` (exponential races, sampling.race_scores): the
    same seed gives the same ids, but not the ids of graphs=False, whose draws come from a CPU
    generator; both are exact samples of the target."""
    timing: bool = False
    """Synchronize around the phases and report their wall times in stats["time_split"]
    (prefill_s, draft_s, verify_s, host_s). Costs a device sync per phase: for attribution, not
    for speed figures. Where draft and verify run as one graph, draft_s is 0 and verify_s holds both."""
    tree_policy: object | None = None
    """Picks the tree per step instead of `tree`: choose() -> Tree, observe(tree, produced_tokens),
    begin_request(), summary() -> dict, largest (a Tree). Made from a TreeArms `tree` (`--tree
    bandit:...`); `tree` becomes its largest arm, which sizes the cache, the pending slots and
    the drafter's buffers."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not is_integer(self.max_new_tokens):
            raise InputError(f"max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise InputError(f"max-new-tokens must be a positive integer, got {self.max_new_tokens}")
        self.sampling = SamplingParams(self.temperature, self.top_k, self.top_p)
        # Checked here, not where first used: a wrong type failed mid-generation with an
        # AttributeError or in torch.manual_seed, or (eos, stop strings) was silently never matched.
        if self.seed is not None and not (is_integer(self.seed) and -2 ** 63 <= self.seed < 2 ** 64):
            raise InputError(f"seed must be an integer (a 64-bit seed) or None, got {self.seed!r}")
        if self.tree is not None and not isinstance(self.tree, (Tree, TreeArms)):
            raise InputError(f"tree must be a Tree, e.g. Tree.from_config((3, 2, 1)), or None; got {self.tree!r}")
        if isinstance(self.stop_strings, str):  # one string, not its characters (each of which stopped the text)
            self.stop_strings = (self.stop_strings,)
        if not _all_of(self.stop_strings, lambda s: isinstance(s, str) and s != ""):
            raise InputError(f"stop_strings must be a list of non-empty strings (an empty one stops at once), "
                             f"got {self.stop_strings!r}")
        eos = self.eos_token_id
        if eos is not None and not (is_integer(eos) or _all_of(eos, is_integer)):
            raise InputError(f"eos_token_id must be a token id, a list of token ids or None, got {eos!r}")
        if isinstance(self.tree, TreeArms):  # `--tree bandit:...`: a UCB policy over the arms (tuning/bandit.py)
            from ..tuning.bandit import UCBTreePolicy
            self.tree_policy = UCBTreePolicy.from_arms(self.tree)
        if self.tree_policy is not None:  # buffers, graphs and pending slots for the largest arm
            self.tree = self.tree_policy.largest
        if self.method == "chain":
            self.tree = self.tree or Tree.chain(DEFAULT_CHAIN)
            # every tree it may draft: a bandit's arms besides its largest
            for tree in self.tree_policy.arms if self.tree_policy is not None else (self.tree,):
                if not tree.is_chain:
                    raise InputError(f"method chain needs a chain (a configuration of ones), got tree {tree.spec()}")
        elif self.method == "stree":
            self.tree = self.tree or Tree.from_config(DEFAULT_STREE)

    @property
    def eos_ids(self) -> set[int]:
        if self.eos_token_id is None:
            return set()
        if is_integer(self.eos_token_id):  # numpy's integers too
            return {int(self.eos_token_id)}
        return {int(e) for e in self.eos_token_id}


@dataclass
class GenerationResult:
    token_ids: list[int]
    """Generated ids only (the prompt excluded)."""
    stats: dict
    accepted_per_call: list[int] = field(default_factory=list)
    """Tokens produced by each decoding target call (drafted tokens accepted + 1)."""
    finish_reason: str = "length"
    text: str | None = None
    """Detokenized output, filled in by `ssmspec.api.generate_text`."""


class _Output:
    """Collects produced tokens and applies the stop conditions."""

    def __init__(self, cfg: GenerationConfig, decode: Callable[[list[int]], str] | None, on_tokens):
        self.cfg, self.decode, self.on_tokens = cfg, decode, on_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    def emit(self, new: list[int]) -> None:
        """Append tokens until a stop condition is met; the stopping token is kept (as transformers)."""
        taken = []
        for tok in new:
            taken.append(tok)
            self.tokens.append(tok)
            if tok in self.cfg.eos_ids:
                self.finish_reason = "eos"
            elif self.cfg.stop_strings and self.decode is not None:
                text = self.decode(self.tokens)
                if any(s in text for s in self.cfg.stop_strings):
                    self.finish_reason = "stop_string"
            if self.finish_reason is None and len(self.tokens) >= self.cfg.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.on_tokens and taken:
            self.on_tokens(taken)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


PENDING_SLOTS = 16
"""Pending input slots per Mamba layer of the fast path's cache: the SSM states are written back
once every few tree iterations instead of after each (0: after each)."""
PENDING_MAX_NODES = 32
"""Trees up to this many nodes use the pending slots; the scan of larger trees pays more for
reading them than the replay saves (measured on the H100 at the 2.7b shape), unless the
verify layers split in_proj (ops/overlap.py): then the scan runs beside z's GEMM, and its extra
time is hidden (64 nodes: 3.30 ms with 16 slots against 3.36 ms without)."""
PENDING_SPLIT_MAX_NODES = 64
"""Trees up to this many nodes use the pending slots where the target's verify splits in_proj."""


def pending_slots_for(tree: Tree | None, target: LanguageModel | None = None) -> int:
    """Pending input slots of the fast path's cache for iterations on `tree` (0: none; None: no
    tree iterations, as for method ar) with `target` (None: as if its verify never split in_proj)."""
    if tree is None:
        return 0
    if tree.num_nodes <= PENDING_MAX_NODES:
        return PENDING_SLOTS
    if tree.num_nodes <= PENDING_SPLIT_MAX_NODES and target is not None and target.verify_splits_in_proj(tree.num_nodes):
        return PENDING_SLOTS
    return 0


class _FastPath:
    """The target's decode calls as CUDA graphs: one per step, one per tree iteration.

    Graphs read and write fixed buffers, so the cache is allocated once per capacity bucket and
    kept between generations in the store its caller holds (an Engine's; reset in place),
    together with its captured graphs.
    """

    BUCKET = 512

    def __init__(self, target: LanguageModel, max_len: int, capture: bool, pending: int = 0):
        self.target, self.capture = target, capture
        # With pending slots the tree iterations keep their accepted tokens' SSM inputs instead
        # of writing every layer's state back each iteration (ReplaySSM; models/cache.py).
        self.cache = target.new_cache(1, max_len, pending=pending)
        self.step_graphs: dict = {}  # SamplingParams -> StepGraph
        self.tree_graphs: dict = {}  # keys end with the SamplingParams the graph samples with
        self.chain_prefill = None
        self.sampling = None  # the sampling setting (temperature > 0) whose graphs are kept

    @classmethod
    def for_target(cls, target: LanguageModel, needed_len: int, capture: bool, store: dict,
                   pending: int = 0) -> "_FastPath":
        """The fast path of `store` (the caller's: an Engine's, or a fresh dict for one call) for
        this size and setting, made there when missing."""
        capacity = -(-needed_len // cls.BUCKET) * cls.BUCKET
        key = (capacity, capture, str(target.device), pending)
        if key not in store:
            store.clear()  # one live set of buffers per store
            store[key] = cls(target, capacity, capture, pending)
        fast = store[key]
        fast.cache.reset_()
        return fast

    def sample_with(self, params: SamplingParams) -> None:
        """Keep the graphs of greedy decoding and of `params` only: a captured graph holds its
        own memory pool, so a caller that changes the temperature per request must not pile
        them up (a new setting captures its graphs again, once)."""
        if params.greedy or params == self.sampling:
            return
        self.sampling = params
        self.step_graphs = {key: g for key, g in self.step_graphs.items() if key.greedy}
        self.tree_graphs = {key: g for key, g in self.tree_graphs.items() if key[-1].greedy}

    def step_graph(self, params: SamplingParams) -> StepGraph:
        """The target's step graph for `params`, captured on first use."""
        graph = self.step_graphs.get(params)
        if graph is None:
            graph = self.step_graphs[params] = StepGraph(self.target, self.cache, params, capture=self.capture)
        return graph

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """The prompt (1, T) into the cache as a few replayed chain graphs; last logits (V,)."""
        if self.chain_prefill is None:
            self.chain_prefill = ChainPrefill(self.target, self.cache, capture=self.capture)
        return self.chain_prefill(prompt)

    def speculation(self, draft, params: SamplingParams) -> "SpeculativeIterationGraph":
        """The whole iteration with a device-side draft (drafters.FusedGreedyDraft)."""
        key = ("fused", draft.shape.parents, draft.sampled, params)
        kept = self.tree_graphs.get(key)
        if kept is None or kept.draft is not draft:  # a new draft object: its buffers moved
            self.tree_graphs[key] = SpeculativeIterationGraph(self.target, self.cache, draft, capture=self.capture,
                                                              params=params)
        return self.tree_graphs[key]

    def iterate(self, draft: Draft, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], list[int], int]:
        """verify + accept + replay in one call; returns (path, accepted tokens, bonus).
        Sampling is exact only for deterministic drafts (draft.q is None; see GreedyTreeGraph)."""
        tree = draft.tree
        key = (tree.parents, params)
        if key not in self.tree_graphs:
            self.tree_graphs[key] = GreedyTreeGraph(self.target, self.cache, tree, capture=self.capture, params=params)
        graph = self.tree_graphs[key]
        tokens, n = graph(draft.tokens.to(self.target.device)[None], generator)
        # One read-back per iteration: accepted length, deepest node, produced tokens.
        packed = torch.cat([n, graph.out_last, tokens[0]]).tolist()
        count, last, produced = packed[0], packed[1], packed[2:]
        return tree.path(last), produced[:count - 1], produced[count - 1]


def prefill(target: LanguageModel, prompt: torch.Tensor, max_len: int, fast: _FastPath | None = None,
            by_chunks: bool | None = None):
    """Run the prompt (1, T) into a fresh cache; returns (cache, last position's logits (V,)).

    With the tree kernels available (a GPU), the prompt goes through `verify` + `replay` as
    chains of at most ChainPrefill.CHUNK tokens (graphs/ChainPrefill; replayed graphs on the fast
    path): the same kernels as decoding, instead of the plain-torch chunked scan. Both give the
    state of stepping the prompt token by token.
    """
    cache = fast.cache if fast is not None else target.new_cache(1, max_len)
    if by_chunks is None:
        by_chunks = dispatch.uses_kernel("tree_scan", target.device)
    if not by_chunks:
        return cache, target(prompt, cache, last_only=True)[0, -1]
    if fast is not None:
        return cache, fast.prefill(prompt)
    return cache, ChainPrefill(target, cache, capture=False)(prompt)


def next_token(logits: torch.Tensor, cfg: GenerationConfig, generator) -> int:
    """The target's own next token from (V,) logits: argmax, or a draw from the processed distribution."""
    if cfg.sampling.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, cfg.sampling), generator)


def fast_next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """`next_token` as the fast path draws it: an exponential race on the logits' device from
    the fast path's device generator (the same draws as its graphs), not multinomial on the host."""
    if params.greedy:
        return int(logits.argmax())
    noise = race_noise_(torch.empty(logits.shape, device=logits.device), generator)
    return int(race_scores(logits, params, noise).argmax())


def draft_tree(drafter, root: int, cfg: GenerationConfig, generator, tree: Tree | None = None) -> Draft:
    return drafter.draft(root, tree or cfg.tree, cfg.sampling, generator)


def verify_tree(target: LanguageModel, draft: Draft, cache):
    return target.verify(draft.tokens.to(target.device)[None], draft.tree, cache)


def accept_path(draft: Draft, target_logits: torch.Tensor, cfg: GenerationConfig, generator):
    """The accepted path (root first) and the bonus token; the one place the rule is chosen."""
    tokens = draft.token_list()
    if cfg.sampling.greedy:
        return accept_greedy(draft.tree, tokens, target_logits.argmax(-1).tolist())
    p = probabilities(target_logits, cfg.sampling)
    if draft.q is None:
        return accept_deterministic(draft.tree, tokens, p, generator)
    return accept_sampled(draft.tree, tokens, p, draft.q, generator)


def replay_state(target: LanguageModel, cache, acts, path: list[int]) -> None:
    device = target.device
    target.replay(cache, acts, torch.tensor([path], device=device), torch.tensor([len(path)], device=device))


def _fast_path(target: LanguageModel, cfg: GenerationConfig, max_len: int, store: dict) -> _FastPath | None:
    if not isinstance(target, LanguageModel):
        return None  # graphs are for ssmspec's own models; other targets (models/hf_causal.py) run eagerly
    on_cuda = target.device.type == "cuda"
    wanted = cfg.graphs if cfg.graphs is not None else on_cuda
    if not wanted:
        return None
    if cfg.method != "ar" and on_cuda and dispatch.get_backend() == "reference":
        return None  # the reference tree ops build masks on the host: they cannot be captured
    fast = _FastPath.for_target(target, max_len, capture=on_cuda, store=store,
                                pending=pending_slots_for(None if cfg.method == "ar" else cfg.tree, target))
    fast.sample_with(cfg.sampling)
    return fast


def drafted_trees(cfg: GenerationConfig) -> tuple:
    """Every tree the loop may draft, largest first (drafters size shared buffers by the first):
    the bandit's arms, or the one configured tree."""
    trees = tuple(cfg.tree_policy.arms) if cfg.tree_policy is not None else (cfg.tree,)
    return tuple(sorted(trees, key=lambda t: -t.num_nodes))


class _PhaseClock:
    """Wall time per phase of the loop when asked (`GenerationConfig.timing`): each `mark`
    waits for the device and charges the time since the last mark to a phase."""

    PHASES = ("prefill_s", "draft_s", "verify_s", "host_s")

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.spent = dict.fromkeys(self.PHASES, 0.0)
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.spent[phase] += now - self.last
        self.last = now

    def totals(self) -> dict:
        return dict(self.spent)


def generate(
    target: LanguageModel,
    input_ids,
    *,
    drafter=None,
    config: GenerationConfig | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate from `input_ids` (a list of ids or a (1, T) tensor) with the configured method,
    leaving `target` (and the drafter's model) as it found them: the same weights, no attribute
    added. (On a GPU the model's `one_launch` decisions and runners, ops/paths.py, are made on
    first use whoever runs it, and stay with the model.)

    Nothing is kept between calls: the target's cache and its CUDA graphs are made for this call
    and dropped after it (on a GPU every call captures its graphs again, the cost of a first
    call). Nor are the norm weights folded into the projections: a model that was never folded
    runs its norms apart from its projections (on a GPU a launch more per norm, and without the
    one-launch CUDA kernels): it computes the model as the caller holds it, where folding would
    move a bf16 model's logits by rounding. Callers that generate repeatedly hold an `Engine`
    (decoding/engine.py) instead, which prepares the models once and keeps its buffers and
    graphs. A ModelDrafter keeps its own buffers between calls: it is an object the caller holds.

    Args:
        target: the model whose outputs are reproduced exactly.
        drafter: a ModelDrafter or NgramDrafter (needed for chain and stree).
        decode: ids -> text, needed only for stop strings.
        on_tokens: called with each batch of newly produced ids (streaming).
    """
    return decode_loop(target, input_ids, drafter=drafter, config=config, decode=decode, on_tokens=on_tokens,
                       fast_paths={})


class _Readback:
    """Two host slots for an iteration's (count, tokens): each copy is queued on the stream
    behind its iteration, so the host can queue the next iteration before reading this one."""

    def __init__(self, device: torch.device, width: int):
        pinned = device.type == "cuda"
        self.slots = [torch.empty(1 + width, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.next = 0

    def queue(self, tokens: torch.Tensor, count: torch.Tensor | None = None) -> int:
        """Queue the copy of tokens (1, up to width) and their count (1,), as an iteration returns
        them (count None: all of them); returns the slot to `read`. A slot is written again two
        queues later, after its read."""
        i, self.next = self.next, self.next ^ 1
        if count is None:
            self.slots[i][0] = tokens.shape[1]
        else:
            self.slots[i][:1].copy_(count, non_blocking=True)
        self.slots[i][1:1 + tokens.shape[1]].copy_(tokens[0], non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        return i

    def read(self, i: int) -> list[int]:
        """The produced tokens of the iteration queued into slot i (waits for it)."""
        if self.events[i] is not None:
            self.events[i].synchronize()
        packed = self.slots[i].tolist()
        return packed[1:1 + packed[0]]


def _step_ahead(fast: "_FastPath", cfg: GenerationConfig, root: int, out: _Output, generator: torch.Generator | None,
                clock: _PhaseClock) -> list[int]:
    """Autoregressive steps on the step graph, which leaves its next input (the argmax or the
    draw) on the device. Untimed, step k + 1 is queued before token k is read, so the host reads
    token k while step k + 1 runs; it is queued only if token k cannot be the last by length (an
    EOS or a stop string leaves one step unread). Timed runs (the clock syncs around phases) read
    each token first. The tokens and the draws are the same either way. Returns the tokens per
    call (all 1)."""
    if out.done:
        return []
    graph = fast.step_graph(cfg.sampling)
    graph.ids.fill_(root)
    reads = _Readback(fast.target.device, 1)
    calls: list[int] = []
    queued = reads.queue(graph.advance(generator))
    while True:
        ahead = None
        if not cfg.timing and len(out.tokens) + 1 < cfg.max_new_tokens:
            ahead = reads.queue(graph.advance(generator))
        token = reads.read(queued)
        clock.mark("verify_s")
        out.emit(token)
        calls.append(1)
        clock.mark("host_s")
        if out.done:
            return calls
        queued = ahead if ahead is not None else reads.queue(graph.advance(generator))


def _speculate_ahead(fast: "_FastPath", drafter: ModelDrafter, cfg: GenerationConfig, root: int, out: _Output,
                     generator: torch.Generator | None, clock: _PhaseClock) -> list[int]:
    """The fused speculative iterations, untimed each queued before the previous one is read.

    An iteration depends on the last one through device buffers only (the drafter's root and
    commit row, the caches; a tree switch's hand-over is device work too), so the host queues
    iteration k + 1 and then waits for iteration k's tokens: the GPU does not idle through the
    host's read-back, bookkeeping and graph launch. Iteration k + 1 is queued only if iteration
    k cannot reach max_new_tokens (it produces at most its depth + 1 tokens); an end by EOS or a
    stop string leaves one queued iteration unread, whose caches nobody reads (the next
    generation resets them). With one tree the produced tokens, their order and the random draws
    are those of reading each iteration first; a tree policy (the bandit) chooses iteration
    k + 1's tree before it has seen iteration k's result (its feedback comes one step late).
    Timed runs (the clock syncs around phases) read each iteration first. Returns the tokens
    produced per read iteration."""
    if out.done:
        return []
    policy = cfg.tree_policy
    if policy is not None:
        policy.begin_request()
    reads = _Readback(fast.target.device, max(tree.max_depth for tree in drafted_trees(cfg)) + 1)
    current = None  # the last queued iteration's draft

    def queue_next() -> tuple[Tree, int]:
        """Queue the next iteration, on the policy's tree or the configured one; (tree, its slot)."""
        nonlocal current
        tree = policy.choose() if policy is not None else cfg.tree
        draft = drafter.fused_draft(tree, cfg.sampling)
        iteration = fast.speculation(draft, cfg.sampling)
        if current is None:
            draft.start(root)
        elif current is not draft:  # the bandit switched trees: the state moves to the new buffers
            current.hand_over(draft)
        current = draft
        tokens, n, _ = iteration(generator)
        return tree, reads.queue(tokens, n)

    accepted_per_call: list[int] = []
    queued = queue_next()
    while True:
        tree, slot = queued
        ahead = None
        if not cfg.timing and len(out.tokens) + tree.max_depth + 1 < cfg.max_new_tokens:
            ahead = queue_next()
        produced = reads.read(slot)
        clock.mark("verify_s")
        drafter.steps += tree.max_depth + 1
        if policy is not None:
            policy.observe(tree, len(produced))
        out.emit(produced)
        accepted_per_call.append(len(produced))
        clock.mark("host_s")
        if out.done:
            return accepted_per_call
        queued = ahead if ahead is not None else queue_next()


def _prompt_ids(input_ids, vocab_size: int) -> torch.Tensor:
    """`input_ids` (a list of ids, a (T,) or (1, T) tensor) as a (1, T) int64 tensor. Refused: a
    batch of several prompts (flattened into one before), ids that are not integers (truncated)
    and ids outside the vocabulary (an IndexError in the embedding)."""
    if isinstance(input_ids, str):
        raise InputError("the prompt is text; give token ids, or use ssmspec.api.generate_text for text")
    try:
        prompt = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"the prompt must be a list or tensor of token ids, got {type(input_ids).__name__} "
                         f"({e})") from None
    if prompt.dim() > 1 and prompt.shape[:-1].numel() != 1:
        raise InputError(f"the prompt has shape {tuple(prompt.shape)}: one sequence at a time, a list of ids or a "
                         "(1, T) tensor (batches of prompts are not supported yet)")
    if prompt.numel() == 0:
        raise InputError("the prompt is empty; give at least one token")
    if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
        raise InputError(f"the prompt must hold integer token ids, got dtype {prompt.dtype}")
    low, high = (int(v) for v in torch.aminmax(prompt))  # both ends in one pass over the ids
    if low < 0 or high >= vocab_size:
        raise InputError(f"the prompt has token id {low if low < 0 else high}, outside the model's vocabulary "
                         f"(0 to {vocab_size - 1})")
    return prompt.to(torch.long).reshape(1, -1)


def _check_drafter(drafter, target) -> None:
    """Refuse what cannot draft for `target`, before anything runs: a model given as the drafter
    (AttributeError at its first draft) and a drafter model of another vocabulary (its tokens
    indexed past the target's embedding)."""
    if not hasattr(drafter, "draft"):
        hint = "ModelDrafter(model)" if isinstance(drafter, torch.nn.Module) else "ModelDrafter(model) or NgramDrafter()"
        raise InputError(f"the drafter must be a ModelDrafter or NgramDrafter, got {type(drafter).__name__}; "
                         f"use {hint}")
    model = getattr(drafter, "model", None)
    if model is not None and model.config.vocab_size != target.config.vocab_size:
        raise InputError(f"the drafter's vocabulary has {model.config.vocab_size} tokens but the target's has "
                         f"{target.config.vocab_size}; both must use the same tokenizer")


@torch.no_grad()
def decode_loop(
    target: LanguageModel,
    input_ids,
    *,
    drafter,
    config: GenerationConfig | None,
    decode: Callable[[list[int]], str] | None,
    on_tokens: Callable[[list[int]], None] | None,
    fast_paths: dict,
) -> GenerationResult:
    """`generate`'s loop, with the fast path (cache and graphs) kept in `fast_paths`: a dict the
    caller holds (an Engine's across calls, or a fresh one). Runs the models as they are."""
    cfg = config or GenerationConfig()
    prompt = _prompt_ids(input_ids, target.config.vocab_size).to(target.device)
    if cfg.method != "ar" and drafter is None:
        raise InputError(f"method {cfg.method} needs a drafter (a model directory or 'ngram')")
    if cfg.method != "ar":
        _check_drafter(drafter, target)
    if cfg.stop_strings and decode is None:  # _Output would never look for them
        raise InputError("stop_strings need decode (ids -> text) to be found; pass decode=tokenizer.decode")
    # Refuse what cannot fit (tree width, context, memory) before allocating anything.
    by_chunks = ChainPrefill.CHUNK if dispatch.uses_kernel("tree_scan", target.device) else None
    check_generation(target, prompt.shape[1], cfg, drafter, prefill_chunk=by_chunks)
    generator = None if cfg.sampling.greedy else torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else 0)
    tree_nodes = cfg.tree.num_nodes if cfg.tree is not None else 1
    max_len = prompt.shape[1] + cfg.max_new_tokens + tree_nodes + 1

    start = time.perf_counter()
    clock = _PhaseClock(cfg.timing, target.device)
    out = _Output(cfg, decode, on_tokens)
    fast = _fast_path(target, cfg, max_len, fast_paths)
    # The fast path draws on the device (exponential races over static noise buffers, refilled
    # from this generator before each replay), the eager path on the host from `generator`.
    fast_generator = None
    if fast is not None and not cfg.sampling.greedy:
        fast_generator = torch.Generator(device=target.device).manual_seed(cfg.seed if cfg.seed is not None else 0)
    cache, logits = prefill(target, prompt, max_len, fast)
    if fast is not None:  # reading the token back also waits for the prefill
        root = fast_next_token(logits, cfg.sampling, fast_generator)
    else:
        root = next_token(logits, cfg, generator)
    if cfg.method != "ar":
        drafter.begin(prompt, max_len)
    prefill_s = time.perf_counter() - start
    clock.mark("prefill_s")
    out.emit([root])
    accepted_per_call: list[int] = []

    if cfg.method == "ar" and fast is not None:
        accepted_per_call = _step_ahead(fast, cfg, root, out, fast_generator, clock)
    elif cfg.method == "ar":
        while not out.done:
            logits = target.step(torch.tensor([[root]], device=target.device), cache)[0, -1]
            root = next_token(logits, cfg, generator)
            clock.mark("verify_s")
            out.emit([root])
            accepted_per_call.append(1)
            clock.mark("host_s")
    elif fast is not None and isinstance(drafter, ModelDrafter) and all(
            drafter.fused_draft(tree, cfg.sampling) is not None for tree in drafted_trees(cfg)):
        # Draft, verify, accept, replay and the drafter's commit as one graph: one read-back a call.
        # When sampling, the children are drawn from the drafter and accepted by speculative
        # sampling on the device, or (sample_children=False) are its top-k, accepted by the naive
        # rule's races (graphs.GreedyTreeGraph); both exact.
        accepted_per_call = _speculate_ahead(fast, drafter, cfg, root, out, fast_generator, clock)
    else:
        policy = cfg.tree_policy
        if policy is not None:
            policy.begin_request()
        while not out.done:
            tree = policy.choose() if policy is not None else cfg.tree
            draft = draft_tree(drafter, root, cfg, generator, tree)
            clock.mark("draft_s")
            # Drafts with q (children sampled i.i.d.) need the SpecInfer rule on the host.
            if fast is not None and draft.tree == tree and draft.q is None:
                path, accepted, bonus = fast.iterate(draft, cfg.sampling, fast_generator)  # verify + accept + replay, one graph
            else:
                logits, acts = verify_tree(target, draft, cache)
                path, bonus = accept_path(draft, logits[0], cfg, generator)
                replay_state(target, cache, acts, path)
                accepted = draft.tokens[path[1:]].tolist()
            clock.mark("verify_s")
            drafter.commit(accepted, path)
            if policy is not None:
                policy.observe(tree, len(accepted) + 1)
            out.emit(accepted + [bonus])
            accepted_per_call.append(len(accepted) + 1)
            root = bonus
            clock.mark("host_s")

    elapsed = time.perf_counter() - start
    calls = len(accepted_per_call)
    new_tokens = len(out.tokens)
    stats = {
        "method": cfg.method,
        # a bandit's arms, not the largest arm it keeps buffers for (which arm ran: "tree_policy")
        "tree": None if cfg.method == "ar" else (cfg.tree_policy.to_arms() if cfg.tree_policy is not None else cfg.tree).spec(),
        "new_tokens": new_tokens,
        "target_calls": calls,
        # The prefill's token is not a decoding call's; a call's tokens = accepted drafts + bonus.
        "mean_accepted": (new_tokens - 1) / calls if calls else 0.0,
        "tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
        "elapsed_s": elapsed,
        "prefill_s": prefill_s,
        # Decoding alone: the tokens after the first, over the time after the prefill.
        "decode_tokens_per_s": (new_tokens - 1) / (elapsed - prefill_s) if elapsed > prefill_s and new_tokens > 1 else 0.0,
        "temperature": cfg.temperature,
        "finish_reason": out.finish_reason,
    }
    if drafter is not None and cfg.method != "ar":
        stats["drafter_steps"] = drafter.steps
    if cfg.timing:
        stats["time_split"] = clock.totals()
    if cfg.tree_policy is not None and cfg.method != "ar":
        stats["tree_policy"] = cfg.tree_policy.summary()
    return GenerationResult(out.tokens, stats, accepted_per_call, out.finish_reason)
