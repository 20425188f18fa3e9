"""Engine against generate: the same ids; generate leaves its models as it found them; no module state grows."""
import sys
import types
import weakref
from collections import deque

import pytest
import torch

from helpers import tiny_model
from ssmspec.decoding import Engine, GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.ops import dispatch
from ssmspec.trees import Tree

TARGET = ("mamba", "attention", "mlp", "mamba")
CASES = [("ar", None), ("chain", Tree.chain(3)), ("stree", Tree.from_config((2, 2, 1)))]
PROMPT = [5, 9, 2, 7, 5, 9, 2, 7, 1, 3]


def model(layers, seed):
    """A tiny model whose norm weights are not ones, so that folding them changes the weights."""
    m = tiny_model(layers, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return m


@pytest.fixture
def fusing_kernels(monkeypatch):
    """The fused-norm kernels reported as running (as on a GPU), so that preparing a model for
    them folds its norms; the folded model then runs the reference norm_linear here."""
    real = dispatch.uses_kernel
    monkeypatch.setattr(dispatch, "uses_kernel", lambda op, device: op == "norm_linear" or real(op, device))


def snapshot(model: torch.nn.Module):
    """Every tensor of the state dict, bit for bit, and every submodule's attribute names."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    attrs = {name: set(vars(module)) for name, module in model.named_modules()}
    return state, attrs


def differences(model: torch.nn.Module, before) -> tuple[list, dict]:
    """(state-dict entries whose bits changed, {submodule: attribute names added or removed})."""
    state, attrs = before
    now_state, now_attrs = snapshot(model)
    assert now_state.keys() == state.keys()
    changed = [k for k in state if not torch.equal(now_state[k].view(torch.uint8), state[k].view(torch.uint8))]
    added = {k: now_attrs[k] ^ attrs.get(k, set()) for k in now_attrs if now_attrs[k] != attrs.get(k)}
    return changed, added


def assert_unchanged(model: torch.nn.Module, before) -> None:
    changed, added = differences(model, before)
    assert not changed, f"weights changed: {changed}"
    assert not added, f"attributes added or removed: {added}"


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method, tree", CASES, ids=[m for m, _ in CASES])
def test_generate_leaves_the_models_as_it_found_them(fusing_kernels, method, tree, graphs):
    target, drafter_model = model(TARGET, 1), model(("mamba", "mlp"), 2)
    before, drafter_before = snapshot(target), snapshot(drafter_model)
    drafter = ModelDrafter(drafter_model, graphs=graphs)
    for _ in range(2):
        generate(target, PROMPT, drafter=drafter, config=GenerationConfig(method=method, tree=tree, max_new_tokens=12,
                                                                          graphs=graphs))
    assert_unchanged(target, before)
    assert_unchanged(drafter_model, drafter_before)


def test_engine_prepares_its_models_in_place_and_keeps_their_ids(fusing_kernels):
    # The check above has power: an Engine folds the same models' norms (its documented charge),
    # which changes their weights and marks their norms; their greedy ids stay ar's (fp32 here).
    target, drafter_model = model(TARGET, 1), model(("mamba", "mlp"), 2)
    before = snapshot(target)
    ar = generate(target, PROMPT, config=GenerationConfig(method="ar", max_new_tokens=16)).token_ids
    engine = Engine(target, ModelDrafter(drafter_model))
    changed, added = differences(target, before)
    assert "layers.0.mixer.in_proj.weight" in changed and "layers.2.norm.weight" in changed
    assert added["layers.0.norm"] == {"_folded_version"}  # the mark models/fold.py leaves
    assert all(layer.norms_folded for layer in target.layers if layer.kind in ("mamba", "mlp"))
    assert all(layer.norms_folded for layer in drafter_model.layers)
    for method, tree in CASES:
        out = engine.generate(PROMPT, GenerationConfig(method=method, tree=tree, max_new_tokens=16))
        assert out.token_ids == ar


def test_engine_prepares_nothing_on_the_reference_path():
    target = model(TARGET, 1)
    before = snapshot(target)
    Engine(target, ModelDrafter(model(("mamba",), 2))).generate(PROMPT, GenerationConfig(max_new_tokens=4))
    assert_unchanged(target, before)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_engine_generates_the_ids_of_generate_and_of_ar(drafter_kind, graphs):
    target = model(TARGET, 3)

    def drafter():
        return NgramDrafter() if drafter_kind == "ngram" else ModelDrafter(model(("mamba",), 4), graphs=graphs)

    ar = generate(target, PROMPT, config=GenerationConfig(method="ar", max_new_tokens=20, graphs=False)).token_ids
    engine = Engine(target, drafter())
    for method, tree in CASES:
        cfg = GenerationConfig(method=method, tree=tree, max_new_tokens=20, graphs=graphs)
        once = generate(target, PROMPT, drafter=drafter(), config=cfg)
        for _ in range(2):  # the second call runs on the kept fast path
            out = engine.generate(PROMPT, cfg)
            assert out.token_ids == once.token_ids == ar
            assert out.accepted_per_call == once.accepted_per_call
    assert (engine.fast_path is not None) == graphs


def test_engine_sampling_equals_generate_with_a_seed():
    target, drafter_model = model(TARGET, 5), model(("mamba",), 6)
    engine = Engine(target, ModelDrafter(drafter_model, graphs=True))
    for method, tree in CASES:
        cfg = GenerationConfig(method=method, tree=tree, max_new_tokens=12, temperature=1.0, seed=11, graphs=True)
        once = generate(target, PROMPT, drafter=ModelDrafter(drafter_model, graphs=True), config=cfg).token_ids
        assert engine.generate(PROMPT, cfg).token_ids == once


def container_sizes() -> dict:
    """Size of every module-level container of ssmspec's loaded modules (dicts, lists, sets,
    weak dictionaries, deques, and functools caches)."""
    kinds = (dict, list, set, deque, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
    sizes = {}
    for name, module in list(sys.modules.items()):
        if not (name == "ssmspec" or name.startswith("ssmspec.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, kinds):
                sizes[f"{name}.{attr}"] = len(value)
            elif callable(getattr(value, "cache_info", None)):
                sizes[f"{name}.{attr}()"] = value.cache_info().currsize
    return sizes


def grown(before: dict, after: dict) -> dict:
    return {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}


def test_a_growing_module_container_is_seen(monkeypatch):
    probe = types.ModuleType("ssmspec._probe")
    probe.kept = []
    monkeypatch.setitem(sys.modules, "ssmspec._probe", probe)
    before = container_sizes()
    probe.kept.append(object())
    assert grown(before, container_sizes()) == {"ssmspec._probe.kept": (0, 1)}


@pytest.mark.parametrize("graphs", [False, True])
def test_no_module_container_grows_across_generations(graphs):
    target, drafter_model = model(TARGET, 7), model(("mamba",), 8)
    g = torch.Generator().manual_seed(0)
    engine = Engine(target, ModelDrafter(drafter_model, graphs=graphs))
    configs = [GenerationConfig(method=m, tree=t, max_new_tokens=10, graphs=graphs) for m, t in CASES]
    sampled = GenerationConfig(method="stree", tree=Tree.from_config((2, 1)), max_new_tokens=10, temperature=1.0,
                               seed=1, graphs=graphs)

    def run_all():  # new prompts of one length, every method, the engine and a one-off generate
        for cfg in configs + [sampled]:
            prompt = torch.randint(0, 64, (12,), generator=g).tolist()
            engine.generate(prompt, cfg)
            generate(target, prompt, drafter=ModelDrafter(drafter_model, graphs=graphs), config=cfg)

    run_all()  # the first calls may fill caches bounded by the settings (kernels, tree masks)
    before = container_sizes()
    run_all()
    run_all()
    assert not grown(before, container_sizes())


def test_generate_text_runs_on_a_held_engine(tmp_path):
    from ssmspec.api import generate_text
    from ssmspec.errors import InputError
    from ssmspec.models.loading import LoadedModel

    loaded = LoadedModel(tiny_model(TARGET, vocab_size=256, seed=9), None, "ssmspec", tmp_path)
    drafter = NgramDrafter()
    cfg = GenerationConfig(method="stree", tree=Tree.from_config((2, 1)), max_new_tokens=12, graphs=True)
    once = generate_text(loaded, "abcabcab", drafter=drafter, config=cfg)
    engine = Engine(loaded.model, drafter)
    for _ in range(2):
        held = generate_text(loaded, "abcabcab", engine=engine, config=cfg)
        assert held.token_ids == once.token_ids and held.text == once.text
    with pytest.raises(InputError, match="another model"):
        generate_text(loaded, "abc", engine=Engine(tiny_model(TARGET, vocab_size=256, seed=9)), config=cfg)
    with pytest.raises(InputError, match="give the drafter to the Engine"):
        generate_text(loaded, "abc", drafter=NgramDrafter(), engine=engine, config=cfg)


def test_folding_drops_the_one_launch_decisions_made_unfolded():
    # A GPU model run unfolded first (by generate) decided "no one-launch kernel: norms not
    # folded"; once an Engine folds it, that decision must be made again.
    target = model(TARGET, 1)
    decided = target.one_launch
    target.fold_norm_weights_()
    assert target.one_launch is not decided
    again = target.one_launch
    target.fold_norm_weights_()  # nothing folded: the decisions stand
    assert target.one_launch is again


@pytest.mark.parametrize("max_new_tokens", [1, 2, 4, 9, 30])
@pytest.mark.parametrize("temperature, drafting", [(0.0, "other"), (1.0, "other"), (0.0, "self")])
def test_iterations_queued_one_ahead_give_the_ids_of_reading_each_first(max_new_tokens, temperature, drafting,
                                                                        monkeypatch):
    """The fused loop queues iteration k + 1 before reading iteration k (generate.py
    _speculate_ahead); timing=True reads each iteration before queueing the next. Same ids,
    calls and accepted counts, at every length (the look-ahead stops before the last), greedy
    and sampled with a seed, drafted by another model or by the target itself, with an EOS in
    the way or not."""
    target = tiny_model(("mamba", "attention", "mamba"), seed=3)
    # self-drafting accepts whole paths: iterations of depth + 1 tokens reach the length exactly
    drafter_model = target if drafting == "self" else tiny_model(("mamba",), seed=4)
    tree = Tree.from_config((2, 1, 1))
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    from ssmspec.decoding.graphs import SpeculativeIterationGraph

    runs = []
    original = SpeculativeIterationGraph.__call__
    monkeypatch.setattr(SpeculativeIterationGraph, "__call__", lambda self, g=None: runs.append(1) or original(self, g))
    results = {}
    for eos in (None, "seen"):
        for timing in (False, True):
            runs.clear()
            engine = Engine(target, ModelDrafter(drafter_model, graphs=True))
            cfg = GenerationConfig(method="stree", tree=tree, max_new_tokens=max_new_tokens, graphs=True,
                                   temperature=temperature, seed=5, timing=timing)
            if eos == "seen":  # the 4th token of the plain run ends the next ones early
                seen = results[(None, False)][0]
                cfg.eos_token_id = seen[min(3, len(seen) - 1)]
            out = engine.generate(prompt, cfg)
            results[(eos, timing)] = (out.token_ids, out.stats["target_calls"], out.accepted_per_call)
            if eos is None:  # ended by length: no iteration ran past the last one read
                assert len(runs) == out.stats["target_calls"]
    for eos in (None, "seen"):
        assert results[(eos, False)] == results[(eos, True)], eos
    assert len(results[(None, False)][0]) == max_new_tokens


@pytest.mark.parametrize("max_new_tokens", [3, 30])
def test_a_bandit_queued_one_ahead_keeps_the_greedy_ids(max_new_tokens, monkeypatch):
    """With a tree policy the fused loop queues iteration k + 1 (its tree chosen before iteration
    k is seen) before reading iteration k: the greedy ids are those of reading each first, every
    read iteration is observed by the policy, and none runs past a length end."""
    from ssmspec.decoding.graphs import SpeculativeIterationGraph
    from ssmspec.trees.tree import parse_tree_spec

    runs = []
    original = SpeculativeIterationGraph.__call__
    monkeypatch.setattr(SpeculativeIterationGraph, "__call__", lambda self, g=None: runs.append(1) or original(self, g))
    target = tiny_model(("mamba", "mamba"), seed=3)
    drafter_model = tiny_model(("mamba",), seed=4)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    ids = {}
    for timing in (False, True):
        runs.clear()
        engine = Engine(target, ModelDrafter(drafter_model, graphs=True))
        cfg = GenerationConfig(method="stree", tree=parse_tree_spec("bandit:2,1;1,1,1,1;3,2"), max_new_tokens=max_new_tokens,
                               graphs=True, timing=timing)
        out = engine.generate(prompt, cfg)
        ids[timing] = out.token_ids
        assert sum(out.stats["tree_policy"]["pulls"]) == out.stats["target_calls"] == len(runs)
    assert ids[False] == ids[True]
    assert ids[False] == Engine(target).generate(prompt, GenerationConfig(method="ar", max_new_tokens=max_new_tokens)).token_ids


@pytest.mark.parametrize("max_new_tokens", [1, 2, 17])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_autoregressive_steps_queued_one_ahead_give_the_ids_of_reading_each_first(max_new_tokens, temperature,
                                                                                  monkeypatch):
    """The fast AR loop chains its steps on the device (StepGraph.advance) and reads token k
    while step k + 1 runs; timing=True reads each token before the next step. Same ids, greedy
    and sampled with a seed, with an EOS in the way or not; no step past a length end."""
    from ssmspec.decoding.graphs import StepGraph

    steps = []
    original = StepGraph.advance
    monkeypatch.setattr(StepGraph, "advance", lambda self, g=None: steps.append(1) or original(self, g))
    target = tiny_model(("mamba", "attention", "mamba"), seed=5)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    results = {}
    for eos in (None, "seen"):
        for timing in (False, True):
            steps.clear()
            cfg = GenerationConfig(method="ar", max_new_tokens=max_new_tokens, graphs=True, temperature=temperature,
                                   seed=9, timing=timing)
            if eos == "seen":
                seen = results[(None, False)]
                cfg.eos_token_id = seen[min(3, len(seen) - 1)]
            out = Engine(target).generate(prompt, cfg)
            results[(eos, timing)] = out.token_ids
            if eos is None and not timing:
                assert len(steps) == out.stats["target_calls"] == max_new_tokens - 1
    for eos in (None, "seen"):
        assert results[(eos, False)] == results[(eos, True)], eos
    if temperature == 0.0:  # and the eager reference loop's
        assert results[(None, False)] == Engine(target).generate(
            prompt, GenerationConfig(method="ar", max_new_tokens=max_new_tokens, graphs=False)).token_ids
