"""The verify layer with in_proj split in two (ops/overlap.py) on a real GPU at the mamba2-2.7b layer
shape, where z's GEMM really runs beside the conv and the scan (opt in: --run-gpu)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ssmspec.ops import dispatch, overlap, paths
from ssmspec.trees import Tree

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"


@pytest.fixture(scope="module")
def model():
    """Two folded bf16 Mamba layers of mamba2-2.7b's shape, a small vocabulary."""
    from ssmspec.models import LanguageModel
    from ssmspec.models.init import init_weights
    from ssmspec.models.presets import preset_config

    cfg = dataclasses.replace(preset_config("mamba2-2.7b", vocab_size=512), layers=["mamba"] * 2)
    m = init_weights(LanguageModel(cfg), seed=0, std=0.02).eval().to(DEV, torch.bfloat16)
    m.fold_norm_weights_()
    return m


@pytest.fixture(autouse=True)
def _triton_backend():
    with dispatch.use_backend("triton"):
        yield


def _prefilled(model, batch, tokens):
    cache = model.new_cache(batch, 128)
    with torch.no_grad():
        model(tokens, cache, last_only=True)
    return cache


@pytest.mark.parametrize("tree_config", [(3, 4, 2, 1), (63,)], ids=["64: 3,4,2,1", "64: flat"])
def test_split_verify_equals_plain_verify_eager_and_in_a_graph(model, tree_config, monkeypatch):
    """The split layer's logits equal the plain layer's (same GEMM tiles; the scan's sums of
    squares may round differently), and every replay of a captured split verify gives the
    eager split logits bit for bit (the counters' protocol under real concurrency)."""
    tree = Tree.from_config(tree_config)
    assert tree.num_nodes >= paths.SPLIT_IN_PROJ_MIN_ROWS
    torch.manual_seed(0)
    cache = _prefilled(model, 1, torch.randint(0, 512, (1, 24), device=DEV))
    tokens = torch.randint(0, 512, (1, tree.num_nodes), device=DEV)
    splits = []
    real = overlap.split_in_proj_counters
    monkeypatch.setattr(overlap, "split_in_proj_counters",
                        lambda *a, **k: splits.append(real(*a, **k)) or splits[-1])
    with torch.no_grad():
        with monkeypatch.context() as plain:
            plain.setattr(paths, "SPLIT_IN_PROJ_MIN_ROWS", 10**6)  # the plain layer
            want, _ = model.verify(tokens, tree, cache)
        assert not any(s is not None for s in splits)
        splits.clear()
        got, _ = model.verify(tokens, tree, cache)
        assert splits and all(s is not None for s in splits)
        assert ((got - want).norm() / want.norm()).item() < 1e-3
        want = got
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.verify(tokens, tree, cache)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, _ = model.verify(tokens, tree, cache)
        for _ in range(50):
            logits.zero_()
            graph.replay()
            assert torch.equal(logits, want)
    torch.cuda.synchronize()
    assert not overlap.ready_counters(torch.device(DEV), model.config.mamba.n_heads).any()


def test_split_refused_when_the_scan_and_z_do_not_fit_side_by_side(model):
    """Batch 2: 160 scan programs, more than the SMs: they could all spin on z's counters while
    z's GEMM waits for an SM, so the layer must not split."""
    c = model.config.mamba
    d_inner = c.n_heads * c.head_dim
    k = model.config.d_model
    rest = d_inner + 2 * c.n_groups * c.d_state + c.n_heads
    args = (d_inner, rest, k, 2, c.n_heads, c.head_dim, torch.device(DEV))
    assert overlap.split_in_proj_counters(64, 1, *args) is not None
    assert overlap.split_in_proj_counters(64, 2, *args) is None  # 32-node trees, batch 2
    assert overlap.split_in_proj_counters(16, 1, *args) is None  # under SPLIT_IN_PROJ_MIN_ROWS
