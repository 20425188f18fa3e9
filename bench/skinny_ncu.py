"""Driver for Nsight Compute: the skinny GEMMs of the 16-node verify at the mamba2-2.7b shapes
(in_proj 10576 x 2560 with the folded pre-norm, out_proj 2560 x 5120 with the gated norm and the
residual), a few launches each, with the product's tables (ops/gemv/triton SKINNY_TUNED).

    ncu --kernel-name regex:_skinny_kernel --launch-skip 4 --launch-count 2 --section ... \\
        python3 bench/skinny_ncu.py [rows]
"""
import sys

import torch

from ssmspec.ops.gemv import triton as gemv

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16
dev, bf = "cuda", torch.bfloat16
h = torch.randn(rows, 2560, device=dev, dtype=bf)
h_sq = (h.float() ** 2).sum(-1).reshape(rows, 1, 1).contiguous()
w_in = torch.randn(10576, 2560, device=dev, dtype=bf) * 0.02
g = torch.randn(rows, 5120, device=dev, dtype=bf)
g_sq = (g.float() ** 2).sum(-1).reshape(rows, 1, 1).contiguous()
w_out = torch.randn(2560, 5120, device=dev, dtype=bf) * 0.02
for _ in range(3):  # in_proj, out_proj, in_proj, out_proj, ...: with --launch-skip 4, one of each
    gemv.norm_linear(h, w_in, None, 1, 1e-5, x_sq=h_sq)
    gemv.norm_linear(g, w_out, None, 1, 1e-5, residual=h, x_sq=g_sq, return_sq=True)
torch.cuda.synchronize()
