"""The sequence conv reference (ops/causal_conv/naive.py) against conv1d, and its conv state."""
import torch
import torch.nn.functional as F

from helpers import assert_close
from ssmspec.ops.causal_conv.naive import naive_causal_conv


def _conv1d_silu(x, weight, bias):
    """What Mamba2Mixer's eager training path computes: conv1d over the left-padded sequence, then silu."""
    K = weight.shape[1]
    out = F.conv1d(F.pad(x, (0, 0, K - 1, 0)).transpose(1, 2), weight[:, None], bias, groups=x.shape[-1])
    return F.silu(out.transpose(1, 2))


def test_the_reference_is_conv1d_then_silu():
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(3, 29, 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    for b in (bias, None):
        assert_close(naive_causal_conv(x, None, weight, b), _conv1d_silu(x, weight, b), atol=1e-6, rtol=1e-6)


def test_the_conv_state_continues_a_sequence():
    """A sequence convolved in two pieces, the second starting from the first's last K-1 inputs
    (in the cache's (B, C, K-1) layout), equals it convolved whole; also a piece shorter than K-1."""
    g = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(2, 20, 8, generator=g), torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    whole = naive_causal_conv(x, None, weight, bias)
    for cut in (2, 11):
        state = F.pad(x[:, :cut], (0, 0, 3 - min(cut, 3), 0))[:, -3:].transpose(1, 2)
        assert_close(naive_causal_conv(x[:, cut:], state, weight, bias), whole[:, cut:], atol=1e-6, rtol=1e-6)
