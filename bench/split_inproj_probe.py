"""Probe: the verify layer with in_proj split in two, z's GEMM beside the conv and scan chain.

In the plain verify layer (`Mamba2Mixer.folded_residual_verify`) the conv and the tree scan run
between in_proj and out_proj while the weight stream idles, although only x, B, C and dt feed
them: the gate z (half of in_proj's weights, 26 MB at mamba2-2.7b) is needed only at the end.
This times the whole greedy tree iteration (bench_decode's `time_tree_iteration`) with the layer
built as:

- plain: in_proj as one GEMM (ops/overlap.SPLIT_IN_PROJ off);
- product: the product's layer (split from ops/overlap.SPLIT_IN_PROJ_MIN_ROWS rows on: z's GEMM
  on a second stream, the scan waiting for z's columns by ready counters);
- the emulations of run 187, before the product had the split (timing only: the scan gates with
  a fixed tensor instead of z, so it need not wait for z's GEMM; outputs are not the model's but
  deterministic, so iterations still accept their full depth):
  - split_serial: in_proj as two GEMMs ([x B C dt] first, then z), all on one stream;
  - z_side: the z GEMM on a second stream, beside the conv and the scan;
  - chain_side: the conv and the scan on the second stream, the z GEMM on the main one;
  - chain_beside_in_proj: the whole in_proj on the main stream, the conv and the scan on the
    second one from fixed inputs, beside it: the ceiling of any overlap of the chain with in_proj.

Run on the GPU from the repository root (after `pip install --no-deps -e .`):

    python3 bench/split_inproj_probe.py [--trees "3,2,1;3,4,2,1"] [--variants plain,product]
        [--half-configs "128,128,4,4,0,2,1/128,128,4,4,0,2,1;..."]

--half-configs sets the skinny GEMM configs of the two halves ([x B C dt] / z) for the tree's
row count (SKINNY_TUNED up to 16 rows, SKINNY_WIDE above), each pair timed in turn.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, "bench")
from bench_decode import median_ms, prefilled_cache, time_tree_iteration  # noqa: E402
from ssmspec.decoding.graphs import StepGraph  # noqa: E402
from ssmspec.models import mamba2  # noqa: E402
from ssmspec.models.presets import build_model  # noqa: E402
from ssmspec.ops import dispatch, overlap  # noqa: E402
from ssmspec.ops.gemv import triton as gemv  # noqa: E402
from ssmspec.trees.tree import Tree  # noqa: E402

# This probe studies the Triton kernels; the default mode would take the one-launch CUDA kernels
# (ops/stream_layers, ops/stream_proj) where they run.
os.environ.setdefault("SSMSPEC_STREAM_LAYERS", "0")

MODE = {"name": "product"}
PRODUCT = mamba2.Mamba2Mixer.folded_residual_verify
EMULATIONS = ("split_serial", "z_side", "chain_side", "chain_beside_in_proj")


def _chain(self, xBC, dt_raw, z, cache, parents, pending):
    """The conv and the gated scan of the product's layer: (x, B, gated, dt, g_sq)."""
    c = self.cfg
    xBC_conv = dispatch.tree_conv(xBC, cache.conv_state, self.conv_weight, self.conv1d.bias, parents)
    x, B, C = self._split_conv_out(xBC_conv)
    gated, dt, g_sq = dispatch.tree_scan_gated(x, dt_raw, self.dt_bias, c.dt_min, c.dt_max, self.A, B, C, self.D,
                                               z, parents, cache.ssm_state, return_sq=True, pending=pending)
    return x, B, gated, dt, g_sq


def _out_proj(self, h, xBC, x, B, gated, dt, g_sq):
    """out_proj with the gated norm and the residual, as the product's layer ends."""
    if g_sq.shape[1] != self.cfg.d_inner // self.norm.group_size:
        g_sq = None
    out, out_sq = dispatch.norm_linear(gated, self.out_proj.weight, self.out_proj.bias,
                                       self.cfg.d_inner // self.norm.group_size, self.norm.eps, residual=h, x_sq=g_sq,
                                       return_sq=True, reuse_residual=True)
    return out, out_sq, mamba2.MambaTreeActivations(xBC=xBC, x=x, dt=dt, B=B)


def _fixed(self, h, width: int) -> torch.Tensor:
    """A fixed random (rows, width) tensor per mixer: the timing-only inputs the emulations read."""
    key = (tuple(h.shape[:-1]), h.dtype, width)
    store = self.__dict__.setdefault("_probe_fixed", {})
    if key not in store:
        store[key] = torch.randn(*h.shape[:-1], width, device=h.device, dtype=h.dtype)
    return store[key]


def probe_verify(self, h, cache, parents, pre_norm_eps, h_sq=None, pending=None):
    mode = MODE["name"]
    if mode not in EMULATIONS:
        return PRODUCT(self, h, cache, parents, pre_norm_eps, h_sq=h_sq, pending=pending)
    c = self.cfg
    w = self.in_proj.weight
    main = torch.cuda.current_stream()
    side = overlap.side_stream(h.device)
    if mode == "chain_beside_in_proj":
        # the ceiling of any overlap of the chain with in_proj: the whole in_proj on the main
        # stream while the conv and the scan run on the second one from fixed inputs
        z, xBC, dt_raw = _fixed(self, h, w.shape[0]).split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            x, B, gated, dt, g_sq = _chain(self, xBC, dt_raw, z, cache, parents, pending)
        z = dispatch.norm_linear(h, w, None, 1, pre_norm_eps, x_sq=h_sq)
        main.wait_stream(side)
        return _out_proj(self, h, xBC, x, B, gated, dt, g_sq)
    xbcdt = dispatch.norm_linear(h, w[c.d_inner:], None, 1, pre_norm_eps, x_sq=h_sq)
    xBC, dt_raw = xbcdt.split([c.conv_dim, c.n_heads], dim=-1)
    stale_z = _fixed(self, h, c.d_inner)  # the scan's gate, so that it need not wait for z's GEMM

    def z_gemm():
        return dispatch.norm_linear(h, w[: c.d_inner], None, 1, pre_norm_eps, x_sq=h_sq)

    if mode == "split_serial":
        z = z_gemm()
        x, B, gated, dt, g_sq = _chain(self, xBC, dt_raw, stale_z, cache, parents, pending)
    elif mode == "z_side":
        side.wait_stream(main)
        with torch.cuda.stream(side):
            z = z_gemm()
        x, B, gated, dt, g_sq = _chain(self, xBC, dt_raw, stale_z, cache, parents, pending)
        main.wait_stream(side)
    else:  # chain_side
        side.wait_stream(main)
        with torch.cuda.stream(side):
            x, B, gated, dt, g_sq = _chain(self, xBC, dt_raw, stale_z, cache, parents, pending)
        z = z_gemm()
        main.wait_stream(side)
    del z  # computed for its cost only
    return _out_proj(self, h, xBC, x, B, gated, dt, g_sq)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,4,2,1")
    ap.add_argument("--variants", default="plain,product,plain")
    ap.add_argument("--half-configs", default="", help="';'-separated 'xbcdt config/z config' pairs (default: the tables')")
    ap.add_argument("--pending", type=int, default=None, help="pending slots (default: the product's choice)")
    ap.add_argument("--min-rows", type=int, default=None, help="ops/overlap.SPLIT_IN_PROJ_MIN_ROWS for 'product'")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("split_inproj_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dispatch.set_backend("triton")
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    mixer = model.layers[0].mixer
    c = mixer.cfg
    k = mixer.in_proj.weight.shape[1]
    halves = [(c.conv_dim + c.n_heads, k), (c.d_inner, k)]
    mamba2.Mamba2Mixer.folded_residual_verify = probe_verify
    if args.min_rows is not None:
        overlap.SPLIT_IN_PROJ_MIN_ROWS = args.min_rows
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    step = StepGraph(model, prefilled_cache(model, prompt, 256))
    ids = prompt[:, -1:].clone()
    ar_ms = median_ms(lambda: step(ids), iters=100)
    print(f"AR step {ar_ms:.3f} ms", flush=True)
    rows = []
    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        table = gemv.SKINNY_TUNED if tree.num_nodes <= gemv.SKINNY_MAX_ROWS else gemv.SKINNY_WIDE
        saved = {shape: table.get(shape) for shape in halves}
        pairs = [p for p in args.half_configs.split(";") if p] or ["tables"]
        for pair in pairs:
            if pair != "tables":
                for shape, cfg_text in zip(halves, pair.split("/")):
                    table[shape] = tuple(int(v) for v in cfg_text.split(","))
            for variant in args.variants.split(","):
                if variant == "plain" and pair != pairs[0]:
                    continue  # the halves' configs do not matter to it
                MODE["name"] = variant
                # before the slots are chosen (pending_slots_for)
                overlap.SPLIT_IN_PROJ = variant == "product"
                info = time_tree_iteration(model, prompt, tree, vocab, args.pending)
                label = f"{tree.num_nodes} nodes {variant:12s} {pair if variant != 'plain' else '-'}"
                accepted = f"accepted {info['accepted']}, chain {info['greedy_chain_matches']}"
                rows.append((label, info["ms"], info["ms"] / ar_ms, accepted))
                print(f"  {label}: {info['ms']:.3f} ms = {info['ms'] / ar_ms:.3f}x AR (cycle "
                      + ", ".join(f"{t:.3f}" for t in info["ms_each"]) + f"), {accepted}", flush=True)
        for shape, cfg in saved.items():
            if cfg is None:
                table.pop(shape, None)
            else:
                table[shape] = cfg
    overlap.SPLIT_IN_PROJ = True
    print(f"\n{torch.cuda.get_device_name()}; {args.preset} folded, random bf16 weights; AR step {ar_ms:.3f} ms")
    print(f"{'what':70s} {'ms':>7s} {'x AR':>6s}  acceptance")
    for label, ms, ratio, accepted in rows:
        print(f"{label:70s} {ms:7.3f} {ratio:6.3f}  {accepted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
