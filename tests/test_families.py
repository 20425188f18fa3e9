"""Hybrid families beyond NemotronH and Bamba (GraniteMoeHybrid, FalconH1, Zamba2, NemotronH's MoE), loaded from their transformers checkpoints.

tests/test_transformers_equivalence.py and tests/test_generate_vs_transformers.py cover each
family's main tiny config (forward, prefill + step, verify on trees, greedy generate); here are
its variants (dense, no RoPE, tied embeddings, no gated norm, one shared block without attention
adapters) and NemotronH with MoE blocks (with greedy generate against transformers' own),
replay against stepping, the native round trip, the MoE layer against a per-row
reference, and the refusal of untied Zamba2 blocks.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_caches_equal, assert_close
from ssmspec.models import MambaLayerCache
from ssmspec.models.config import MoEConfig
from ssmspec.models.loading import load_model
from ssmspec.models.loading.save import save_model
from ssmspec.models.moe import MoE
from ssmspec.trees import Tree

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (tests/hf_models.py: the tiny transformers oracles)

VOCAB = hf_models.VOCAB
ATOL, RTOL = 2e-5, 1e-4

VARIANTS = {
    "granite-moe": lambda: hf_models.granitemoehybrid(),
    "granite-dense-nope": lambda: hf_models.granitemoehybrid(experts=0, rope=False, seed=7),
    "granite-tied": lambda: _tied(hf_models.granitemoehybrid(seed=8)),
    "falcon-h1-tied": lambda: _tied(hf_models.falcon_h1(seed=9)),
    "falcon-h1-no-gate-norm": lambda: hf_models.falcon_h1(seed=10, gate_norm=False),
    "zamba2-one-block-nope": lambda: hf_models.zamba2(seed=11, blocks=1, attention_adapters=False, rope=False),
    "nemotron-h-moe-latent": lambda: hf_models.nemotron_h_moe(),
    "nemotron-h-moe": lambda: hf_models.nemotron_h_moe(seed=13, latent=None),
}


def test_zamba2_with_untied_uses_of_a_block_is_refused(tmp_path):
    """transformers leaves Zamba2's shared blocks untied without tied embeddings: such a checkpoint
    is another function than Zamba2's, and loading says so instead of picking one copy."""
    from ssmspec.errors import ModelLoadError

    ref = hf_models.zamba2(seed=12)
    cfg = ref.config
    cfg.tie_word_embeddings = False
    untied = type(ref)(cfg)
    hf_models.randomize(untied, seed=12)
    assert not torch.equal(untied.model.layers[1].shared_transformer.self_attn.q_proj.weight,
                           untied.model.layers[4].shared_transformer.self_attn.q_proj.weight)
    untied.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="shared block"):
        load_model(tmp_path)


def _tied(ref):
    """The same model with its LM head tied to the embeddings (Granite 4.0-H ships tied)."""
    cfg = ref.config
    cfg.tie_word_embeddings = True
    tied = type(ref)(cfg)
    state = ref.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    tied.load_state_dict(state)
    return tied.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = VARIANTS[request.param]()
    out = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(out)
    return ref, load_model(out).model


def _ids(batch, length, seed):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_variant_forward_and_verify_match_transformers(pair):
    ref, ours = pair
    ids = _ids(2, 14, seed=1)
    expected = ref(input_ids=ids, use_cache=False).logits.float()
    assert expected.std() > 0.1, "reference logits are flat: the test would prove nothing"
    assert_close(ours(ids), expected, atol=ATOL, rtol=RTOL, name="forward logits")
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 3, 2, 6])
    prompt, tokens = ids[:, :9], _ids(2, tree.num_nodes, seed=2)
    cache = ours.new_cache(2, max_len=9 + tree.num_nodes)
    ours(prompt, cache)
    logits, _ = ours.verify(tokens, tree, cache)
    for node in range(tree.num_nodes):
        seq = torch.cat([prompt, tokens[:, tree.path(node)]], dim=1)
        want = ref(input_ids=seq, use_cache=False).logits[:, -1].float()
        assert_close(logits[:, node], want, atol=ATOL, rtol=RTOL, name=f"verify node {node}")


@pytest.mark.parametrize("pending", [0, 4], ids=["state", "pending-slots"])
@torch.no_grad()
def test_replay_equals_stepping(pair, pending):
    _, ours = pair
    tree = Tree.from_config((3, 2, 2))
    batch = 3
    ids, tokens = _ids(batch, 6, seed=3), _ids(batch, tree.num_nodes, seed=4)
    cache = ours.new_cache(batch, 40, pending=pending)
    ours(ids, cache)
    stepped = cache.clone()
    _, acts = ours.verify(tokens, tree, cache)
    paths = [tree.path(tree.leaves()[-1]), tree.path(2), [0]]  # full depth, partial, root only
    width = max(map(len, paths))
    ours.replay(cache, acts, torch.tensor([p + [0] * (width - len(p)) for p in paths]),
                torch.tensor([len(p) for p in paths]))
    ours.settle(cache)
    for row, p in enumerate(paths):
        row_cache = stepped.select(torch.tensor([row]))
        for n in p:
            ours.step(tokens[row:row + 1, n:n + 1], row_cache)
        assert_caches_equal(cache.select(torch.tensor([row])), row_cache)
    nxt = _ids(batch, 1, seed=5)
    out = ours.step(nxt, cache)
    for row, p in enumerate(paths):
        seq = torch.cat([ids[row], tokens[row, p], nxt[row]])[None]
        assert_close(out[row, 0], ours(seq)[0, -1], atol=1e-5, name=f"row {row} after replay")


@torch.no_grad()
def test_native_round_trip_keeps_the_function(pair, tmp_path):
    _, ours = pair
    assert save_model(ours, tmp_path / "native") == "ssmspec"
    again = load_model(tmp_path / "native").model
    ids = _ids(2, 10, seed=6)
    assert_close(again(ids), ours(ids), atol=0, rtol=0, name="native round trip")


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each row alone through its top-k experts, written out: the MoE layer's spec."""
    out = []
    for row in x:
        logits = moe.router.weight @ row
        top, experts = logits.topk(moe.cfg.top_k)
        total = moe.shared(row)
        for w, e in zip(torch.softmax(top, dim=0), experts.tolist()):
            gate, up = (moe.experts.gate_up_proj[e] @ row).chunk(2)
            total = total + w * (moe.experts.down_proj[e] @ (moe.experts.act(gate) * up))
        out.append(total)
    return torch.stack(out)


@pytest.mark.parametrize("rows", [1, 7, 63])
@torch.no_grad()
def test_moe_paths_equal_the_reference_and_are_per_token(rows):
    torch.manual_seed(rows)
    moe = MoE(24, MoEConfig(n_experts=5, top_k=3, d_intermediate=12, shared_intermediate=10))
    for p in moe.parameters():
        p.copy_(0.3 * torch.randn(p.shape))
    h = torch.randn(1, rows, 24)
    expected = _reference_moe(moe, h[0])
    assert_close(moe(h)[0], expected, atol=1e-5, name="MoE forward")
    x = h[0]
    weights, experts = moe.route(x)
    shared = moe.shared(x)
    for path in ("by_expert", "gathered", "dense"):  # the eager path and the two capturable ones
        got = getattr(moe.experts, path)(x, experts, weights) + shared
        assert_close(got, expected, atol=1e-5, name=f"experts.{path}")
    # Per-token routing: each row alone gives what it gives among the others (a tree's nodes
    # are just more rows).
    alone = torch.cat([moe(h[:, r:r + 1]) for r in range(rows)], dim=1)
    assert_close(alone, moe(h), atol=1e-6, name="row alone")
    if rows > 7:
        assert len({tuple(e) for e in experts.sort(-1).values.tolist()}) > 1, "routing is trivial"


@pytest.mark.parametrize("preset", ["tiny-moe-hybrid", "tiny-parallel-hybrid", "tiny-shared-hybrid"])
@torch.no_grad()
def test_native_presets_verify_equals_stepping_each_path(preset):
    """The new layer structures at random native weights: verify on a tree equals stepping each
    root-to-node path alone, from a prefilled cache (the MoE, the parallel block and the shared
    blocks need nothing from transformers to hold their own paths together)."""
    from ssmspec.models.presets import build_model

    model = build_model(preset, seed=3, std=0.2)
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 3, 2])
    ids, tokens = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, tree.num_nodes))
    cache = model.new_cache(2, 32)
    full = model(ids)
    assert_close(model(ids, cache), full, atol=1e-5, name="prefill with a cache")
    logits, _ = model.verify(tokens, tree, cache)
    for node in range(tree.num_nodes):
        path_cache = cache.clone()
        for n in tree.path(node):
            out = model.step(tokens[:, n:n + 1], path_cache)
        assert_close(logits[:, node], out[:, 0], atol=1e-4, name=f"{preset} node {node}")


@pytest.mark.parametrize("latent", [24, None], ids=["latent", "no-latent"])
def test_nemotron_h_moe_greedy_generate_equals_transformers(tmp_path, latent):
    """NemotronH with MoE blocks: greedy chain and static-tree ids equal transformers' greedy
    `generate`, with an unrelated drafter and with n-gram (no binding time-step clamp, which
    transformers' cached path skips)."""
    from helpers import tiny_model
    from ssmspec.decoding import GenerationConfig, ModelDrafter, NgramDrafter, generate

    ref = hf_models.nemotron_h_moe(clamp=False, seed=14, latent=latent)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path).model
    unrelated = tiny_model(("mamba",), vocab_size=VOCAB, seed=123)
    ids = _ids(1, 9, seed=15)[0].tolist()
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    for method, tree in [("chain", Tree.chain(3)), ("stree", Tree.from_config((3, 2, 1)))]:
        for drafter in (ModelDrafter(unrelated), NgramDrafter()):
            got = generate(ours, ids, drafter=drafter,
                           config=GenerationConfig(method=method, tree=tree, max_new_tokens=16))
            assert got.token_ids == expected, f"{method} with {type(drafter).__name__}"


@pytest.mark.parametrize("name", ["granite-moe", "falcon-h1-no-gate-norm", "zamba2-one-block-nope", "nemotron-h-moe"])
@torch.no_grad()
def test_bf16_family_runs_every_path(name, tmp_path):
    """In bf16 (loading converts), every path runs and the SSM states stay fp32; the logits stay
    near the fp32 model's."""
    VARIANTS[name]().save_pretrained(tmp_path)
    full = load_model(tmp_path).model
    half = load_model(tmp_path, dtype="bf16").model
    ids, tree = _ids(1, 7, seed=16), Tree.from_config((2, 2))
    cache = half.new_cache(1, 32, pending=2)
    logits = half(ids, cache)
    assert_close(logits, full(ids), atol=0.15, rtol=0.1, name="bf16 vs fp32 forward")
    assert all(c.ssm_state.dtype == torch.float32 for c in cache.layers if isinstance(c, MambaLayerCache))
    out, acts = half.verify(_ids(1, tree.num_nodes, seed=17), tree, cache)
    half.replay(cache, acts, torch.tensor([[0, 2, 6]]), torch.tensor([3]))
    step = half.step(_ids(1, 1, seed=18), cache)
    assert torch.isfinite(out).all() and torch.isfinite(step).all() and int(cache.seqlen) == 11
