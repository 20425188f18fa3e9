"""The plain-torch references agree with the token-by-token recurrence along every path."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from ssmspec.ops.chunk_scan import naive_chunk_scan, naive_sequential_scan
from ssmspec.ops.state_replay import naive_replay_conv_state, naive_replay_ssm_state
from ssmspec.ops.tree_conv import naive_tree_conv
from ssmspec.ops.tree_scan import naive_tree_scan
from ssmspec.trees import Tree


def ssm_inputs(batch, n, heads, headdim, groups, dstate):
    x = torch.randn(batch, n, heads, headdim)
    dt = F.softplus(torch.randn(batch, n, heads) - 1)
    A = -torch.rand(heads) * 4 - 0.1
    B = torch.randn(batch, n, groups, dstate)
    C = torch.randn(batch, n, groups, dstate)
    D = torch.randn(heads)
    h0 = torch.randn(batch, heads, headdim, dstate)
    return x, dt, A, B, C, D, h0


TREES = [Tree.chain(0), Tree.chain(7), Tree.from_config((2, 2, 1)), Tree.from_config((3, 1, 2)),
         Tree.from_parents([-1, 0, 1, 0, 3, 3, 1, 6, 2])]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.spec())
@pytest.mark.parametrize("heads, groups", [(3, 1), (4, 2)])
def test_tree_scan_equals_scanning_each_path_alone(tree, heads, groups):
    x, dt, A, B, C, D, h0 = ssm_inputs(2, tree.num_nodes, heads, 5, groups, 6)
    y = naive_tree_scan(x, dt, A, B, C, D, tree.parents_tensor(), h0)
    for node in range(tree.num_nodes):
        p = tree.path(node)
        y_path, _ = naive_sequential_scan(x[:, p], dt[:, p], A, B[:, p], C[:, p], D, h0)
        assert_close(y[:, node], y_path[:, -1], atol=1e-4, name=f"node {node}")


@pytest.mark.parametrize("steps, chunk", [(1, 4), (7, 4), (16, 4), (33, 8)])
def test_chunk_scan_equals_sequential(steps, chunk):
    x, dt, A, B, C, D, h0 = ssm_inputs(2, steps, 4, 3, 2, 5)
    y_ref, h_ref = naive_sequential_scan(x, dt, A, B, C, D, h0)
    y, h = naive_chunk_scan(x, dt, A, B, C, D, chunk, h0)
    assert_close(y, y_ref, atol=1e-4, name="y")
    assert_close(h, h_ref, atol=1e-4, name="final state")


def test_chunk_scan_is_differentiable():
    x, dt, A, B, C, D, _ = ssm_inputs(1, 10, 2, 3, 1, 4)
    x.requires_grad_(True)
    y, _ = naive_chunk_scan(x, dt, A, B, C, D, 4)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.spec())
@pytest.mark.parametrize("kernel", [2, 4])
def test_tree_conv_follows_each_path(tree, kernel):
    batch, channels = 2, 6
    xBC = torch.randn(batch, tree.num_nodes, channels)
    state = torch.randn(batch, channels, kernel - 1)
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    out = naive_tree_conv(xBC, state, weight, bias, tree.parents_tensor())
    for node in range(tree.num_nodes):
        seq = torch.cat([state.transpose(1, 2), xBC[:, tree.path(node)]], dim=1)  # prefix then the path
        window = seq[:, -kernel:]  # (B, K, C)
        expected = F.silu((window * weight.T).sum(1) + bias)
        assert_close(out[:, node], expected, atol=1e-5, name=f"node {node}")


def test_replay_equals_stepping_the_path():
    tree = Tree.from_config((2, 2, 2))
    batch, heads, headdim, groups, dstate, channels, kernel = 3, 4, 3, 2, 5, 7, 4
    x, dt, A, B, _, _, h0 = ssm_inputs(batch, tree.num_nodes, heads, headdim, groups, dstate)
    xBC = torch.randn(batch, tree.num_nodes, channels)
    conv0 = torch.randn(batch, channels, kernel - 1)
    paths = [tree.path(9), tree.path(4), tree.path(0)]  # lengths 4, 3, 1
    path = torch.tensor([p + [0] * (4 - len(p)) for p in paths])  # padded with junk node 0
    path_len = torch.tensor([len(p) for p in paths])
    ssm, conv = h0.clone(), conv0.clone()
    naive_replay_ssm_state(ssm, x, dt, A, B, path, path_len)
    naive_replay_conv_state(conv, xBC, path, path_len)
    for b, p in enumerate(paths):
        _, h_ref = naive_sequential_scan(x[b:b + 1, p], dt[b:b + 1, p], A, B[b:b + 1, p], B[b:b + 1, p], None, h0[b:b + 1])
        assert_close(ssm[b:b + 1], h_ref, atol=1e-5, name=f"ssm row {b}")
        seq = torch.cat([conv0[b].T, xBC[b, p]], dim=0)
        assert_close(conv[b], seq[-(kernel - 1):].T, atol=0, name=f"conv row {b}")


def test_cached_tree_tensors_made_under_inference_mode_still_train():
    """Index tensors and masks are cached across calls; one first built under
    torch.inference_mode must still serve a later autograd graph (a cached inference tensor used
    to make the next training-mode verify fail: 'Inference tensors cannot be saved for backward')."""
    from ssmspec.ops.tree_conv.naive import naive_tree_conv
    from ssmspec.ops.tree_scan.naive import naive_tree_scan
    from ssmspec.trees import Tree

    tree = Tree.from_parents([-1, 0, 0, 1, 3])  # a shape no other test caches first
    batch, n, heads, head_dim, d_state = 1, tree.num_nodes, 2, 4, 8
    with torch.inference_mode():
        parents = tree.parents_tensor()
        naive_tree_conv(torch.randn(batch, n, 6), torch.randn(batch, 6, 3), torch.randn(6, 4), None, parents)
        naive_tree_scan(torch.randn(batch, n, heads, head_dim), torch.rand(batch, n, heads), -torch.rand(heads),
                        torch.randn(batch, n, 1, d_state), torch.randn(batch, n, 1, d_state), None, parents,
                        torch.randn(batch, heads, head_dim, d_state))
    xbc = torch.randn(batch, n, 6, requires_grad=True)
    x = torch.randn(batch, n, heads, head_dim, requires_grad=True)
    parents = tree.parents_tensor()
    assert not parents.is_inference() and not tree.mask_tensor().is_inference()
    out = naive_tree_conv(xbc, torch.randn(batch, 6, 3), torch.randn(6, 4), None, parents).sum()
    out = out + naive_tree_scan(x, torch.rand(batch, n, heads), -torch.rand(heads), torch.randn(batch, n, 1, d_state),
                                torch.randn(batch, n, 1, d_state), None, parents,
                                torch.randn(batch, heads, head_dim, d_state)).sum()
    out.backward()
    assert xbc.grad is not None and x.grad is not None
