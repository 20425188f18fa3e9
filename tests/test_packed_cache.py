"""Row-packed caches (models/cache.py packed_mamba_rows): the same states as the plain layout, row
copies and gathers in one launch, and a fused draft that gives the same ids on either layout."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import tiny_model
from ssmspec.decoding import GenerationConfig, ModelDrafter, generate
from ssmspec.decoding import drafters as drafters_module
from ssmspec.decoding.drafters import FusedGreedyDraft
from ssmspec.models.cache import ROW_ALIGN, MambaLayerCache
from ssmspec.ops import dispatch
from ssmspec.trees import Tree

STACKS = {"mamba2": ("mamba", "mamba"), "hybrid": ("mamba", "attention", "mlp", "mamba")}


def _fill(cache, seed):
    """Random states and lengths (never zeros: an unwritten row must show)."""
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        for t in ([] if layer is None else [t for t in vars(layer).values() if t is not None]):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    cache.seqlen.copy_(torch.randint(1, 40, cache.seqlen.shape, generator=g))


def _states(cache):
    """Every tensor of the cache, in order (the layout-independent contents)."""
    out = [cache.seqlen]
    for layer in cache.layers:
        out += [] if layer is None else [t for t in vars(layer).values() if t is not None]
    return out


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(_states(a), _states(b), strict=True))


@pytest.mark.parametrize("stack", STACKS)
def test_packed_layout_holds_each_rows_states_in_one_aligned_span(stack):
    model = tiny_model(STACKS[stack]).to(torch.bfloat16)  # bf16 conv states beside fp32 SSM states
    cache = model.new_cache(3, 64, packed=True)
    rows = cache.packed_rows
    base, row_bytes = rows.data_ptr(), rows.stride(0) * rows.element_size()
    assert row_bytes % ROW_ALIGN == 0
    spans = []
    for layer in cache.layers:
        if isinstance(layer, MambaLayerCache):
            assert layer.ssm_state.dtype == torch.float32 and layer.conv_state.dtype == torch.bfloat16
            for t in (layer.ssm_state, layer.conv_state):
                assert t.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
                assert t.stride(0) * t.element_size() == row_bytes and (t.data_ptr() - base) % ROW_ALIGN == 0
                spans.append((t.data_ptr() - base, t.data_ptr() - base + t[0].numel() * t.element_size()))
    spans.append((cache.seqlen.data_ptr() - base, cache.seqlen.data_ptr() - base + 8))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "tensors overlap inside the row"
    assert spans[-1][1] <= row_bytes
    with pytest.raises(ValueError, match="pending"):
        model.new_cache(2, 64, pending=2, packed=True)


@pytest.mark.parametrize("stack", STACKS)
def test_packed_gather_and_copy_equal_the_plain_layout(stack):
    model = tiny_model(STACKS[stack])
    plain_src, packed_src = model.new_cache(5, 64), model.new_cache(5, 64, packed=True)
    _fill(plain_src, seed=1)
    packed_src.copy_(plain_src)  # plain -> packed: the per-tensor fallback
    assert _equal(packed_src, plain_src)
    rows = torch.tensor([4, 0, 0, 2])
    plain, packed = model.new_cache(6, 64), model.new_cache(6, 64, packed=True)
    _fill(plain, seed=2)
    packed.copy_(plain)
    # a gather into a view of rows 1..4 (as a draft level's rows): rows 0 and 5 must stay
    plain.rows(1, 4).gather_(plain_src, rows)
    packed.rows(1, 4).gather_(packed_src, rows)
    assert _equal(packed, plain)
    # a row copy between views (as the root's state into node row 0), and a whole-cache copy
    plain.rows(5, 1).copy_(plain_src.rows(3, 1))
    packed.rows(5, 1).copy_(packed_src.rows(3, 1))
    assert _equal(packed, plain)
    mixed = model.new_cache(4, 64)
    mixed.gather_(packed_src, rows)  # packed -> plain: the fallback
    plain_gathered = model.new_cache(4, 64)
    plain_gathered.gather_(plain_src, rows)
    assert _equal(mixed, plain_gathered)
    # steps on the packed rows advance the same states as on the plain ones
    ids = torch.randint(0, 64, (6, 1))
    assert torch.equal(model.step(ids, packed), model.step(ids, plain))
    assert _equal(packed, plain)
    packed.reset_()
    assert not packed.packed_rows.any()


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("tree", [Tree.chain(4), Tree.from_config((3, 2, 1))], ids=lambda t: t.spec())
def test_fused_draft_gives_the_same_ids_packed_or_plain(stack, tree, monkeypatch):
    target = tiny_model(STACKS[stack], seed=1)
    drafter_model = tiny_model(STACKS[stack], seed=1)
    with torch.no_grad():  # a close drafter: partial acceptance, so commits hit every depth
        drafter_model.lm_head.weight.add_(torch.randn_like(drafter_model.lm_head.weight) * 0.25)
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = GenerationConfig(method="stree", tree=tree, max_new_tokens=30, graphs=True)
    runs = {}
    for layout in ("packed", "plain"):
        if layout == "plain":
            monkeypatch.setattr(drafters_module, "_row_packed_cache", lambda m, b, n: m.new_cache(b, n))
        drafter = ModelDrafter(drafter_model, graphs=True)
        runs[layout] = (generate(target, ids, drafter=drafter, config=cfg), drafter)
    (packed, d_packed), (plain, d_plain) = runs["packed"], runs["plain"]
    assert d_packed.cache.packed_rows is not None and d_plain.cache.packed_rows is None
    assert next(iter(d_packed._fused.values())).node_cache.packed_rows is not None
    assert packed.token_ids == plain.token_ids
    assert packed.accepted_per_call == plain.accepted_per_call
    assert len(set(plain.accepted_per_call)) > 1, "want partial acceptance, not all or nothing"
    assert _equal(d_packed.cache, d_plain.cache)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that do work (not views) while not paused: the launches on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))

    def pausing(self, fn):
        def run(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1
        return run


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_draft_state_bookkeeping_launches(layers, monkeypatch):
    """The ops of a fused draft besides the drafter's steps and the child picks: on packed caches
    one gather per level, and a gather and a copy at the root step, whatever the depth of
    the drafter; the plain layout takes one per tensor (2 per Mamba layer, and seqlen)."""
    model = tiny_model(("mamba",) * layers, seed=2)
    tree = Tree.from_config((2, 2, 1))
    counts = {}
    for layout in ("packed", "plain"):
        if layout == "plain":
            monkeypatch.setattr(drafters_module, "_row_packed_cache", lambda m, b, n: m.new_cache(b, n))
        drafter = ModelDrafter(model, graphs=True)
        drafter.begin(torch.tensor([[1, 2, 3, 4]]), 32)
        draft = FusedGreedyDraft(drafter, tree)
        draft.start(5)
        counter = _OpCounter()
        monkeypatch.setattr(drafter.model, "step", counter.pausing(drafter.model.step))
        monkeypatch.setattr(dispatch, "ranked_tokens", counter.pausing(dispatch.ranked_tokens))
        with torch.no_grad(), counter:
            logits = draft.step_root()
            root_ops = list(counter.ops)
            level_ops = []
            for i in range(len(draft.levels)):
                counter.ops = []
                logits = draft.draft_level(i, logits)
                level_ops.append(list(counter.ops))
        monkeypatch.undo()
        counts[layout] = (root_ops, level_ops)
    (root, levels), (plain_root, plain_levels) = counts["packed"], counts["plain"]
    assert [len(ops) for ops in levels] == [1] * 3, levels
    assert all(ops == [torch.ops.aten.index_select.out] for ops in levels)
    assert len(root) == 2, root  # the commit gather, the root's row into node row 0 (root is tokens[0])
    # the plain layout's count, so that the counter above is known to see these ops
    assert [len(ops) for ops in plain_levels] == [2 * layers + 1] * 3
    assert len(plain_root) == 2 * (2 * layers + 1)
