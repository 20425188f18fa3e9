"""Driver for Nsight Compute: the gated tree scan at the mamba2-2.7b shape, a few launches.

    ncu --kernel-name regex:_tree_scan_kernel --launch-skip 2 --launch-count 1 --section ... \\
        python3 bench/scan_ncu.py 3,4,2,1
"""
import sys

import torch

from scan_probe import inputs  # bench/ is this script's directory
from ssmspec.ops.tree_scan import triton as scan
from ssmspec.trees import Tree

tree = Tree.from_config(tuple(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "3,4,2,1").split(",")))
x, dt_raw, dt_bias, lo, hi, A, B, C, D, z, h0 = inputs(tree.num_nodes)
parents = tree.parents_tensor("cuda")
for _ in range(4):
    scan.tree_scan_gated(x, dt_raw, dt_bias, lo, hi, A, B, C, D, z, parents, h0, return_sq=True)
torch.cuda.synchronize()
