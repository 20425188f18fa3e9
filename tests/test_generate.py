"""The decode loop: lossless against autoregressive decoding, self-drafting, exact sampling."""
import itertools

import pytest
import torch
from scipy.stats import chisquare

from helpers import tiny_model
from ssmspec.decoding import Engine, GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.errors import InputError
from ssmspec.trees import Tree

TARGETS = {
    "mamba2": ("mamba", "mamba", "mamba"),
    "hybrid": ("mamba", "attention", "mlp", "mamba", "attention"),
}
SHAPES = [("chain", Tree.chain(4)), ("stree", Tree.from_config((3, 2, 1))), ("stree", Tree.from_config((2, 2, 2, 1)))]


def prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    # a repetitive prompt gives the n-gram drafter something to find
    out.append(([5, 9, 2, 7] * 6)[:length])
    return out


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("method, shape", SHAPES, ids=lambda x: x if isinstance(x, str) else x.spec())
@pytest.mark.parametrize("drafter_kind", ["unrelated", "hybrid-drafter", "ngram"])
def test_speculative_greedy_equals_autoregressive(arch, method, shape, drafter_kind):
    target = tiny_model(TARGETS[arch], seed=1)
    for ids in prompts(2, 10, 64):
        ref = generate(target, ids, config=GenerationConfig(method="ar", max_new_tokens=24))
        drafter = {
            "unrelated": lambda: ModelDrafter(tiny_model(("mamba",), seed=99)),
            "hybrid-drafter": lambda: ModelDrafter(tiny_model(("mamba", "attention"), seed=98)),  # KV cache per branch
            "ngram": NgramDrafter,
        }[drafter_kind]()
        out = generate(target, ids, drafter=drafter, config=GenerationConfig(method=method, tree=shape, max_new_tokens=24))
        assert out.token_ids == ref.token_ids
        assert out.stats["new_tokens"] == 24


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("config", [(1, 1, 1), (3, 2, 1), (2, 2, 2, 1)])
def test_self_drafting_accepts_every_level(arch, config):
    target = tiny_model(TARGETS[arch], seed=2)
    g = len(config)
    out = generate(target, prompts(1, 8, 64)[0], drafter=ModelDrafter(target),
                   config=GenerationConfig(method="stree", tree=Tree.from_config(config), max_new_tokens=1 + 6 * (g + 1)))
    assert out.accepted_per_call == [g + 1] * 6
    assert out.stats["mean_accepted"] == g + 1


def test_unrelated_drafter_is_often_rejected():
    # Guards the losslessness tests above against a drafter that always agrees.
    target = tiny_model(TARGETS["mamba2"], seed=1)
    out = generate(target, prompts(1, 10, 64)[0], drafter=ModelDrafter(tiny_model(("mamba",), seed=99)),
                   config=GenerationConfig(method="chain", tree=Tree.chain(4), max_new_tokens=30))
    assert out.stats["mean_accepted"] < 2.5


def test_stop_conditions():
    target = tiny_model(TARGETS["mamba2"], seed=1)
    ids = prompts(1, 10, 64)[0]
    ref = generate(target, ids, config=GenerationConfig(method="ar", max_new_tokens=20)).token_ids
    eos = ref[5]
    first = ref.index(eos)
    for method in ("ar", "stree"):
        out = generate(target, ids, drafter=ModelDrafter(target),
                       config=GenerationConfig(method=method, max_new_tokens=20, eos_token_id=eos))
        assert out.token_ids == ref[:first + 1] and out.finish_reason == "eos"
    decode = lambda toks: " ".join(map(str, toks))  # noqa: E731
    stop = f"{ref[3]} {ref[4]}"
    out = generate(target, ids, drafter=NgramDrafter(), decode=decode,
                   config=GenerationConfig(method="chain", max_new_tokens=20, stop_strings=[stop]))
    assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(method="beam"), dict(top_p=0.0),
                                 dict(method="chain", tree=Tree.from_config((2, 1)))])
def test_bad_generation_config(bad):
    with pytest.raises(InputError):
        GenerationConfig(**bad)


def test_empty_prompt_and_missing_drafter():
    target = tiny_model(TARGETS["mamba2"])
    with pytest.raises(InputError, match="empty"):
        generate(target, [], config=GenerationConfig(method="ar"))
    with pytest.raises(InputError, match="drafter"):
        generate(target, [1, 2], config=GenerationConfig(method="chain"))


# -- exact sampling ---------------------------------------------------------------------------

SAMPLE_VOCAB = 4
NEW = 3


@torch.no_grad()
def exact_joint(target, prompt, temperature=1.0, top_p=1.0, top_k=0):
    """P(t1, t2, t3) of the target's own sampling, by enumerating all continuations."""
    from ssmspec.decoding.sampling import SamplingParams, probabilities

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    dist = {}
    for seq in itertools.product(range(SAMPLE_VOCAB), repeat=NEW):
        ids = torch.tensor([prompt + list(seq)])
        probs = probabilities(target(ids)[0, len(prompt) - 1:-1], params)  # (NEW, V)
        dist[seq] = float(torch.prod(probs[torch.arange(NEW), list(seq)]))
    return dist


def empirical(target, prompt, drafter_factory, method, tree, runs, temperature=1.0, top_p=1.0, engine=None, **config):
    """Counts of the produced ids over `runs` seeds; with `engine` (made with the drafter) its
    generate runs, keeping one fast path, instead of `generate` with drafter_factory()'s drafter."""
    counts = {}
    for seed in range(runs):
        cfg = GenerationConfig(method=method, tree=tree, max_new_tokens=NEW, temperature=temperature, top_p=top_p, seed=seed,
                               **config)
        if engine is not None:
            out = engine.generate(prompt, cfg)
        else:
            out = generate(target, prompt, drafter=drafter_factory() if drafter_factory else None, config=cfg)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_pvalue(counts, dist, runs):
    keys = sorted(dist, key=lambda k: -dist[k])
    observed, expected = [], []
    obs_tail = exp_tail = 0.0
    for k in keys:  # pool rare outcomes so every cell expects >= 5
        if dist[k] * runs >= 5:
            observed.append(counts.get(k, 0))
            expected.append(dist[k] * runs)
        else:
            obs_tail += counts.get(k, 0)
            exp_tail += dist[k] * runs
    if exp_tail > 0:
        observed.append(obs_tail)
        expected.append(exp_tail)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


RUNS = 1500


@pytest.fixture(scope="module")
def sampling_pair():
    target = tiny_model(("mamba", "attention", "mamba"), vocab_size=SAMPLE_VOCAB, seed=3, std=0.6)
    drafter = tiny_model(("mamba",), vocab_size=SAMPLE_VOCAB, seed=4, std=0.6)
    return target, drafter, [1, 3, 0, 2, 1]


@pytest.mark.parametrize("method, tree, top_p", [("chain", Tree.chain(2), 1.0), ("stree", Tree.from_config((2, 2)), 1.0),
                                                 ("stree", Tree.from_config((3, 1)), 0.8)])
def test_sampling_matches_the_target_distribution(sampling_pair, method, tree, top_p):
    target, drafter, prompt = sampling_pair
    dist = exact_joint(target, prompt, top_p=top_p)
    counts = empirical(target, prompt, lambda: ModelDrafter(drafter), method, tree, RUNS, top_p=top_p)
    # The bound: a chi-square goodness-of-fit test over the 64 joint outcomes of 3 tokens
    # (rare ones pooled) must not reject at the 0.1% level.
    assert chi_square_pvalue(counts, dist, RUNS) > 1e-3


def test_sampling_check_has_power(sampling_pair):
    # The drafter's own samples must be rejected by the same test: it can tell the two apart.
    target, drafter, prompt = sampling_pair
    counts = empirical(drafter, prompt, None, "ar", None, RUNS)
    assert chi_square_pvalue(counts, exact_joint(target, prompt), RUNS) < 1e-3


def test_sampling_is_reproducible_with_a_seed(sampling_pair):
    target, drafter, prompt = sampling_pair
    cfg = GenerationConfig(method="stree", tree=Tree.from_config((2, 2)), max_new_tokens=12, temperature=1.0, seed=7)
    a = generate(target, prompt, drafter=ModelDrafter(drafter), config=cfg).token_ids
    b = generate(target, prompt, drafter=ModelDrafter(drafter), config=cfg).token_ids
    assert a == b


# -- exact sampling on the fast path (graphs=True: the CUDA-graph code, run eagerly on the CPU) --

FAST_RUNS = 600


@pytest.mark.parametrize("tree, params, sample_children", [
    (Tree.from_config((2, 2)), dict(temperature=1.0), True),
    (Tree.from_config((3, 1)), dict(temperature=1.0), True),
    (Tree.from_config((3, 1)), dict(temperature=0.8, top_k=3, top_p=0.9), True),
    (Tree.from_config((2, 2)), dict(temperature=1.0), False),
], ids=["sampled-2,2-T1", "sampled-3,1-T1", "sampled-3,1-topk-topp", "topk-2,2-T1"])
def test_fused_fast_path_sampling_matches_the_target_distribution(sampling_pair, tree, params, sample_children):
    # The whole iteration as one (here eager) graph must sample the target exactly, with
    # children drawn from the drafter and SpecInfer on the device (the default), or with top-k
    # children and the naive rule's races (sample_children=False).
    from ssmspec.decoding.sampling import SamplingParams

    target, drafter_model, prompt = sampling_pair
    engine = Engine(target, ModelDrafter(drafter_model, sample_children=sample_children, graphs=True))
    counts = empirical(target, prompt, None, "stree", tree, FAST_RUNS, graphs=True, engine=engine, **params)
    iteration = engine.fast_path.tree_graphs[("fused", tree.parents, sample_children, SamplingParams(**params))]
    assert (iteration.verify.draft_q is not None) == sample_children
    assert chi_square_pvalue(counts, exact_joint(target, prompt, **params), FAST_RUNS) > 1e-3


def test_fast_path_per_call_iteration_sampling_matches_the_target_distribution(sampling_pair):
    # A deterministic draft handed to the fast path (fast.iterate: verify + race acceptance +
    # replay); a draft with sampled children (draft.q) must stay on the host's SpecInfer rule.
    from ssmspec.decoding.sampling import SamplingParams

    target, drafter_model, prompt = sampling_pair
    tree, params = Tree.from_config((2, 1)), SamplingParams(temperature=1.0)
    drafter = ModelDrafter(drafter_model, sample_children=False, graphs=True)
    drafter.fused_draft = lambda shape, params=None: None  # as for a tree the device-side draft cannot take
    engine = Engine(target, drafter)
    counts = empirical(target, prompt, None, "stree", tree, FAST_RUNS // 2, graphs=True, engine=engine)
    assert (tree.parents, params) in engine.fast_path.tree_graphs
    assert chi_square_pvalue(counts, exact_joint(target, prompt), FAST_RUNS // 2) > 1e-3

    sampled = ModelDrafter(drafter_model, graphs=True)  # sample_children: drafts carry q
    sampled.fused_draft = lambda shape, params=None: None
    engine = Engine(target, sampled)
    engine.generate(prompt, GenerationConfig(method="stree", tree=Tree.from_config((2, 2, 1)), max_new_tokens=8,
                                             temperature=1.0, graphs=True))
    assert (Tree.from_config((2, 2, 1)).parents, params) not in engine.fast_path.tree_graphs


def test_autoregressive_fast_path_sampling_matches_the_target_distribution(sampling_pair):
    target, _, prompt = sampling_pair
    counts = empirical(target, prompt, None, "ar", None, FAST_RUNS // 2, graphs=True)
    assert chi_square_pvalue(counts, exact_joint(target, prompt), FAST_RUNS // 2) > 1e-3


@pytest.mark.parametrize("wrong", ["argmax-acceptance", "children-not-drawn"])
def test_fast_path_sampling_check_has_power(sampling_pair, monkeypatch, wrong):
    # The same end-to-end check rejects a fast path that takes the argmax where it should race
    # (naive rule), or whose children are the drafter's argmax while SpecInfer takes them for
    # draws from q (a child noise buffer never refilled).
    from ssmspec.decoding import drafters, graphs

    target, drafter_model, prompt = sampling_pair
    if wrong == "argmax-acceptance":
        monkeypatch.setattr(graphs, "race_scores", lambda logits, params, noise: logits.float())
    else:
        monkeypatch.setattr(drafters, "race_noise_", lambda noise, generator: noise.fill_(1.0))
    sample_children = wrong != "argmax-acceptance"  # the races decide only for top-k children
    counts = empirical(target, prompt, lambda: ModelDrafter(drafter_model, sample_children=sample_children, graphs=True),
                       "stree", Tree.from_config((2, 2)), 200, graphs=True)
    assert chi_square_pvalue(counts, exact_joint(target, prompt), 200) < 1e-3


@torch.no_grad()
def iteration_outcomes(target, prompt, tree, tokens, params):
    """The exact law of the tokens that one iteration on a fixed draft produces under the
    deterministic-draft rule: walk down while the target's draw at a node is a child's token."""
    from ssmspec.decoding.sampling import probabilities

    children = tree.child_lists()
    dist = {}

    def walk(node, produced, prob):
        ids = prompt + [tokens[i] for i in tree.path(node)]  # teacher-forced through the plain forward
        p = probabilities(target(torch.tensor([ids]))[0, -1], params)
        for v in range(SAMPLE_VOCAB):
            child = next((c for c in children[node] if tokens[c] == v), None)
            if child is None:
                dist[produced + (v,)] = prob * float(p[v])
            else:
                walk(child, produced + (v,), prob * float(p[v]))

    walk(0, (), 1.0)
    return dist


@torch.no_grad()
def batched_iteration(target, prompt, tree, tokens, params, rows):
    """One GreedyTreeGraph iteration (eager) on `rows` copies of the same prefix and draft, each
    row with its own noise: {produced tokens: count}."""
    from ssmspec.decoding.graphs import GreedyTreeGraph

    cache = target.new_cache(rows, len(prompt) + tree.num_nodes + 1)
    target(torch.tensor([prompt]).expand(rows, -1), cache, last_only=True)
    graph = GreedyTreeGraph(target, cache, tree, capture=False, params=params)
    out, n = graph(torch.tensor([tokens]).expand(rows, -1), torch.Generator().manual_seed(0))
    counts = {}
    for row, length in zip(out.tolist(), n.tolist()):
        counts[tuple(row[:length])] = counts.get(tuple(row[:length]), 0) + 1
    return counts


ROWS = 6000


def _fixed_draft(tree):
    """Distinct tokens among siblings, so the rule has a choice at every node."""
    tokens = [1]
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        rank = tree.parents[1:node].count(parent)
        tokens.append((tokens[parent] + 1 + rank) % SAMPLE_VOCAB)
    return tokens


RULES = [(Tree.from_config((2, 2)), dict(temperature=1.0)),
         (Tree.from_config((3, 2, 1)), dict(temperature=0.7, top_k=3, top_p=0.9))]


@pytest.mark.parametrize("tree, params", RULES, ids=["T1", "topk-topp"])
def test_race_acceptance_is_the_deterministic_draft_rule(sampling_pair, tree, params):
    # Many rows at once: the device-side acceptance with per-node races must produce each token
    # sequence (accepted drafts, then the bonus) with exactly the rule's probability.
    from ssmspec.decoding.sampling import SamplingParams

    target, _, prompt = sampling_pair
    params = SamplingParams(**params)
    tokens = _fixed_draft(tree)
    dist = iteration_outcomes(target, prompt, tree, tokens, params)
    assert abs(sum(dist.values()) - 1) < 1e-5 and max(len(k) for k in dist) == tree.max_depth + 1
    counts = batched_iteration(target, prompt, tree, tokens, params, ROWS)
    assert chi_square_pvalue(counts, dist, ROWS) > 1e-3


@pytest.mark.parametrize("wrong", ["argmax", "one-noise-per-row"])
def test_race_acceptance_check_has_power(sampling_pair, monkeypatch, wrong):
    # Plain argmax, or one noise vector shared by all nodes of a row (draws no longer
    # independent across depths), must be rejected by the same check.
    from ssmspec.decoding import graphs
    from ssmspec.decoding.sampling import SamplingParams

    if wrong == "argmax":
        monkeypatch.setattr(graphs, "race_scores", lambda logits, params, noise: logits.float())
    else:
        def shared(noise, generator):
            return noise.copy_(torch.empty_like(noise[:, :1]).exponential_(generator=generator).expand_as(noise))
        monkeypatch.setattr(graphs, "race_noise_", shared)
    target, _, prompt = sampling_pair
    tree, params = RULES[0][0], SamplingParams(**RULES[0][1])
    tokens = _fixed_draft(tree)
    counts = batched_iteration(target, prompt, tree, tokens, params, ROWS)
    assert chi_square_pvalue(counts, iteration_outcomes(target, prompt, tree, tokens, params), ROWS) < 1e-3


@pytest.mark.parametrize("method", ["ar", "stree", "stree-topk"])
def test_fast_path_sampling_is_reproducible_with_a_seed(sampling_pair, method):
    target, drafter_model, prompt = sampling_pair
    drafter = None
    if method != "ar":
        drafter = ModelDrafter(drafter_model, sample_children=method == "stree", graphs=True)

    def ids(seed):
        cfg = GenerationConfig(method=method.split("-")[0], tree=Tree.from_config((2, 2)) if drafter else None,
                               max_new_tokens=12, temperature=1.0, seed=seed, graphs=True)
        return generate(target, prompt, drafter=drafter, config=cfg).token_ids

    assert ids(7) == ids(7)
    assert len({tuple(ids(seed)) for seed in range(4)}) > 1


def test_fast_path_keeps_the_graphs_of_greedy_and_the_latest_temperature_only():
    # Graphs are built per sampling setting; a caller changing the temperature per request must
    # not pile them up (on a GPU each captured graph holds its own memory pool).
    from ssmspec.decoding.sampling import SamplingParams

    target = tiny_model(TARGETS["mamba2"], seed=1)
    engine = Engine(target, ModelDrafter(tiny_model(("mamba",), seed=99), graphs=True))
    for method in ("stree", "ar"):
        for temperature in (0.0, 1.0, 0.5):
            engine.generate(prompts(1, 6, 64)[0], GenerationConfig(
                method=method, max_new_tokens=4, temperature=temperature, graphs=True))
        fast = engine.fast_path
        kept = set(fast.step_graphs) | {key[-1] for key in fast.tree_graphs}
        assert kept == {SamplingParams(), SamplingParams(temperature=0.5)}


@pytest.mark.parametrize("drafter_layers", [("mamba",), ("mamba", "attention")])
def test_drafter_state_follows_the_produced_text(drafter_layers):
    # The drafter keeps the state of the deepest accepted node instead of re-reading the text;
    # at every draft its prediction for the root must equal a fresh run over all text so far.
    import copy

    target = tiny_model(drafter_layers, seed=1)
    drafter_model = copy.deepcopy(target)  # a perturbed copy: agrees with the target only sometimes
    with torch.no_grad():
        drafter_model.lm_head.weight.add_(torch.randn_like(drafter_model.lm_head.weight) * 0.25)
    ids = prompts(1, 10, 64)[1]
    emitted: list[int] = []
    drafter = ModelDrafter(drafter_model)
    real_feed = drafter._feed
    checks = []

    def checked_feed(tokens):
        logits = real_feed(tokens)
        expected = drafter_model(torch.tensor([ids + emitted]))[:, -1]
        checks.append(float((logits - expected).abs().max()))
        return logits

    drafter._feed = checked_feed
    out = generate(target, ids, drafter=drafter, on_tokens=emitted.extend,
                   config=GenerationConfig(method="stree", tree=Tree.from_config((2, 2, 1)), max_new_tokens=40))
    # Partial acceptance at several depths, so every branch of the state reuse is exercised.
    assert len(set(out.accepted_per_call)) >= 3, out.accepted_per_call
    assert len(checks) == out.stats["target_calls"] and max(checks) < 1e-4, checks


@pytest.mark.parametrize("arch", TARGETS)
def test_device_side_iteration_equals_the_host_loop(arch):
    # graphs=True on the CPU runs the CUDA-graph code path eagerly: greedy acceptance on the device,
    # buffers reused across generations. It must give the host loop's tokens and acceptance.
    target = tiny_model(TARGETS[arch], seed=1)
    perturbed = tiny_model(TARGETS[arch], seed=1)
    with torch.no_grad():
        perturbed.lm_head.weight.add_(torch.randn_like(perturbed.lm_head.weight) * 0.25)
    for ids in prompts(2, 10, 64):
        for method, shape in SHAPES:
            for drafter_model in (target, perturbed):
                drafter = ModelDrafter(drafter_model, graphs=True)  # its draft "graph", run eagerly here
                runs = [generate(target, ids, drafter=ModelDrafter(drafter_model, graphs=False),
                                 config=GenerationConfig(method=method, tree=shape, max_new_tokens=20, graphs=False))]
                runs += [generate(target, ids, drafter=drafter,  # twice: the second reuses the kept buffers
                                  config=GenerationConfig(method=method, tree=shape, max_new_tokens=20, graphs=True))
                         for _ in range(2)]
                assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
                assert runs[0].accepted_per_call == runs[1].accepted_per_call == runs[2].accepted_per_call
        ar = [generate(target, ids, config=GenerationConfig(method="ar", max_new_tokens=12, graphs=g)).token_ids
              for g in (False, True)]
        assert ar[0] == ar[1]


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_prefill_by_chunks_equals_the_full_forward(arch, length):
    # The GPU prefill (chains of 64 through verify + replay) must leave the cache and logits of
    # the plain forward, across chunk boundaries.
    from ssmspec.decoding.generate import prefill

    target = tiny_model(TARGETS[arch], seed=4)
    prompt = torch.randint(0, 64, (1, length))
    cache_a, logits_a = prefill(target, prompt, 200, by_chunks=False)
    cache_b, logits_b = prefill(target, prompt, 200, by_chunks=True)
    torch.testing.assert_close(logits_b, logits_a, atol=1e-4, rtol=1e-4)
    nxt = torch.tensor([[7]])
    torch.testing.assert_close(target.step(nxt, cache_b), target.step(nxt, cache_a), atol=1e-4, rtol=1e-4)


def test_chain_prefill_sizes_cover_any_length_with_few_shapes():
    from ssmspec.decoding.graphs import ChainPrefill

    seen = set()
    for length in range(1, 300):
        sizes = ChainPrefill.sizes(length)
        assert sum(sizes) == length and all(a >= b for a, b in zip(sizes, sizes[1:]))
        seen.update(sizes)
    assert seen == {64, 32, 16, 8, 4, 2, 1}  # every prompt length compiles and captures at most these


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("length", [1, 5, 64, 150])
@pytest.mark.parametrize("pending", [0, 16])
def test_chain_prefill_equals_the_full_forward(arch, length, pending):
    # The GPU prefill replays one graph per chain size (run eagerly here): same logits and state
    # as the plain forward, with and without the fast path's pending slots.
    from ssmspec.decoding.generate import prefill
    from ssmspec.decoding.graphs import ChainPrefill

    target = tiny_model(TARGETS[arch], seed=4)
    prompt = torch.randint(0, 64, (1, length))
    cache_a, logits_a = prefill(target, prompt, 200, by_chunks=False)
    cache_b = target.new_cache(1, 200, pending=pending)
    chains = ChainPrefill(target, cache_b, capture=False)
    logits_b = chains(prompt)
    torch.testing.assert_close(logits_b, logits_a, atol=1e-4, rtol=1e-4)
    nxt = torch.tensor([[7]])
    torch.testing.assert_close(target.step(nxt, cache_b), target.step(nxt, cache_a), atol=1e-4, rtol=1e-4)
    cache_b.reset_()  # reused for a second prompt, as the fast path does
    torch.testing.assert_close(chains(prompt), logits_a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", TARGETS)
def test_bandit_on_the_device_side_iteration_equals_the_host_loop(arch):
    # With a tree policy the fused iteration switches trees between calls (FusedGreedyDraft.hand_over):
    # the ids must be the host loop's, and the drafter's state must follow across the switches.
    from ssmspec.trees.tree import parse_tree_spec

    target = tiny_model(TARGETS[arch], seed=1)
    perturbed = tiny_model(TARGETS[arch], seed=1)
    with torch.no_grad():
        perturbed.lm_head.weight.add_(torch.randn_like(perturbed.lm_head.weight) * 0.25)
    arms = parse_tree_spec("bandit:2,1;1,1,1;3,2")
    ids = prompts(1, 10, 64)[0]
    runs = []
    # the host loop, the device loop reading each iteration first (timing), and the device loop
    # queueing one ahead, whose bandit sees each result a step late (so picks other trees)
    for graphs, timing in ((False, False), (True, True), (True, False)):
        cfg = GenerationConfig(method="stree", tree=arms, max_new_tokens=30, graphs=graphs, timing=timing)
        runs.append(generate(target, ids, drafter=ModelDrafter(perturbed, graphs=graphs), config=cfg))
    ar = generate(target, ids, config=GenerationConfig(method="ar", max_new_tokens=30, graphs=False))
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids == ar.token_ids
    assert runs[0].accepted_per_call == runs[1].accepted_per_call  # same trees: the same acceptance
    for run in runs[1:]:
        assert min(run.stats["tree_policy"]["pulls"]) >= 1 and sum(run.stats["tree_policy"]["pulls"]) == run.stats["target_calls"]
    assert runs[0].stats["tree"] == arms.spec()  # the arms, not the largest one alone


def test_warm_up_prepares_every_prefill_chain_and_tree(monkeypatch):
    # After warm_up a generation with any prompt length meets only prepared chain sizes and trees.
    from ssmspec.ops import dispatch
    from ssmspec.trees.tree import parse_tree_spec

    real = dispatch.uses_kernel  # prefill by chains, as on a GPU (the reference ops run them here)
    monkeypatch.setattr(dispatch, "uses_kernel", lambda op, device: op == "tree_scan" or real(op, device))

    target = tiny_model(TARGETS["mamba2"], seed=2)
    drafter = ModelDrafter(tiny_model(TARGETS["mamba2"], seed=3), graphs=True)
    arms = parse_tree_spec("bandit:2,1;1,1,1")
    engine = Engine(target, drafter)
    engine.warm_up(GenerationConfig(method="stree", tree=arms, graphs=True))
    fast = engine.fast_path
    assert set(fast.chain_prefill._chains) == {64, 32, 16, 8, 4, 2, 1}
    assert set(drafter._prefill._chains) == {64, 32, 16, 8, 4, 2, 1}
    assert {key[1] for key in fast.tree_graphs if key[0] == "fused"} == {arm.parents for arm in arms.arms}


def test_fused_drafts_of_one_drafter_share_their_buffers():
    # A bandit switching trees hands nothing over: every tree of a drafter drafts in one set of
    # buffers, sized by the largest; a larger tree later starts a new set (and new drafts).
    target = tiny_model(TARGETS["mamba2"], seed=1)
    drafter = ModelDrafter(tiny_model(TARGETS["mamba2"], seed=2), graphs=True)
    drafter.begin(torch.tensor([[1, 2, 3]]), 64)
    big, small = drafter.fused_draft(Tree.from_config((3, 2))), drafter.fused_draft(Tree.from_config((1, 1)))
    assert small.buffers is big.buffers and big.buffers.capacity == 10 and small.root is big.root
    small.hand_over(big)  # nothing to copy
    larger = drafter.fused_draft(Tree.from_config((4, 3)))
    assert larger.buffers is not big.buffers and larger.buffers.capacity == 17
    assert drafter.fused_draft(Tree.from_config((1, 1))) is not small  # rebuilt on the new buffers


def _close_pair(seed=1):
    """A tiny target and a drafter close to it (its weights slightly perturbed), as a distilled pair."""
    import copy

    target = tiny_model(TARGETS["hybrid"], seed=seed)
    drafter_model = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for weight in drafter_model.parameters():
            weight.add_(torch.randn(weight.shape, generator=g) * 0.02)
    return target, drafter_model


def test_sampled_children_are_accepted_more_often_than_top_k_at_temperature_1():
    # The reason for SpecInfer on the device: at T=1 the naive rule accepts a child only when
    # the target's own draw is among the top-k, while children drawn from a close drafter are
    # accepted with probability ~ 1 - TV(p, q). Same prompts and seeds for both rules.
    target, drafter_model = _close_pair()
    mean = {}
    for sample_children in (True, False):
        drafter = ModelDrafter(drafter_model, sample_children=sample_children, graphs=True)
        calls = tokens = 0
        for seed, ids in enumerate(prompts(3, 10, 64)):
            out = generate(target, ids, drafter=drafter, config=GenerationConfig(
                method="stree", tree=Tree.from_config((3, 2, 1)), max_new_tokens=40, temperature=1.0, seed=seed,
                graphs=True))
            calls, tokens = calls + out.stats["target_calls"], tokens + out.stats["new_tokens"] - 1
        mean[sample_children] = tokens / calls
    print(f"tokens per call at T=1, stree 3,2,1: sampled children {mean[True]:.2f}, top-k {mean[False]:.2f}")
    assert mean[True] > 1.5 * mean[False], mean


@pytest.mark.parametrize("sample_children", [True, False])
def test_bandit_samples_on_the_device_side_iteration(sample_children):
    # At T=1 the bandit switches trees between fused iterations (drafts sharing their buffers):
    # every pull is observed, the sampled drafts are used, and a seed gives the same ids.
    from ssmspec.trees.tree import parse_tree_spec

    target, drafter_model = _close_pair()
    engine = Engine(target, ModelDrafter(drafter_model, sample_children=sample_children, graphs=True))

    def run(seed):
        cfg = GenerationConfig(method="stree", tree=parse_tree_spec("bandit:2,1;1,1,1;3,2"), max_new_tokens=40,
                               temperature=1.0, seed=seed, graphs=True)
        return engine.generate(prompts(1, 10, 64)[0], cfg)

    out = run(3)
    pulls = out.stats["tree_policy"]["pulls"]
    assert min(pulls) >= 1 and sum(pulls) == out.stats["target_calls"] and out.stats["new_tokens"] == 40
    assert {key[2] for key in engine.fast_path.tree_graphs if key[0] == "fused"} == {sample_children}
    assert run(3).token_ids == out.token_ids


def test_fused_drafts_are_keyed_by_how_children_are_chosen():
    # Greedy drafts stay the top-k (no q, no noise); T > 0 gets a sampled draft in the same
    # buffers; sample_children=False keeps the top-k at any temperature.
    from ssmspec.decoding.sampling import SamplingParams

    tree = Tree.from_config((2, 1))
    for sample_children in (True, False):
        drafter = ModelDrafter(tiny_model(TARGETS["mamba2"], seed=2), sample_children=sample_children, graphs=True)
        drafter.begin(torch.tensor([[1, 2, 3]]), 64)
        greedy = drafter.fused_draft(tree)
        assert drafter.fused_draft(tree, SamplingParams()) is greedy and not greedy.sampled and greedy.q is None
        hot = drafter.fused_draft(tree, SamplingParams(temperature=1.0))
        assert hot.sampled == sample_children and (hot is greedy) == (not sample_children)
        assert hot.buffers is greedy.buffers
