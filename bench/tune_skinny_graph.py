"""Skinny GEMM configs of a model's two Mamba projections, timed inside the tree iteration.

A kernel's time alone (bench_kernels.py --skinny-sweep, skinny_probe.py) does not rank configs
the way the whole CUDA-graph iteration does (neighbouring kernels, PDL overlap). This builds the
model once and, for every (in_proj config, out_proj config) pair, times the greedy tree
iteration as bench_decode.py does (verify + accept + replay graph, events, median), plus the
AR step for the ratio. Configs are `ops/gemv/triton.SKINNY_TUNED` tuples (16 rows or fewer) or
`SKINNY_WIDE` tuples (17..64 rows): (block_n, block_k, warps, stages[, per_sm[, tma]]).

Run on the GPU from the repository root (after `pip install --no-deps -e .`):

    python3 bench/tune_skinny_graph.py --preset mamba2-2.7b --trees "3,2,1;3,4,2,1"
"""
from __future__ import annotations

import argparse
import os
import copy
import sys

import torch

from bench_decode import median_ms, prefilled_cache, time_tree_iteration  # bench/ is this script's directory
from ssmspec.decoding.graphs import StepGraph
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch
from ssmspec.ops.gemv import triton as gemv
from ssmspec.ops.tree_conv import triton as conv
from ssmspec.ops.tree_scan import triton as scan
from ssmspec.trees.tree import Tree

# This probe studies the Triton kernels; the default mode would take the one-launch CUDA kernels
# (ops/stream_layers, ops/stream_proj) where they run.
os.environ.setdefault("SSMSPEC_STREAM_LAYERS", "0")

# candidates per row range, tried one projection at a time (the other at its best so far); the
# current table entry is always timed too
# Round 9 added the tiles that fit every program on the SMs at once (bench/kernel_resources.py:
# the 64-row in_proj's 128 x 128 boxes take 192 KB, one program per SM, 83 programs on 132 SMs):
# in_proj 64 x 128 boxes in 2-3 stages or 64 x 64 boxes, out_proj 16- and 32-column tiles of
# 128-wide boxes.
NARROW_IN = [(64, 128, 4, 4, 0, 2, 1), (128, 128, 4, 4, 0, 2, 1), (32, 256, 4, 4, 0, 1, 2), (64, 128, 4, 4, 0, 1, 2),
             (64, 128, 4, 4, 0, 1, 3), (32, 128, 4, 4, 0, 1, 3), (64, 64, 4, 4, 0, 2, 1), (64, 128, 4, 4, 0, 2, 2),
             (64, 128, 4, 4, 0, 2, 3), (64, 128, 8, 4, 0, 2, 3), (64, 128, 4, 3, 0, 2, 3), (64, 128, 4, 5, 0, 2, 3),
             (128, 128, 4, 4, 0, 2, 3)]
NARROW_OUT = [(32, 256, 2, 4, 0, 1, 2), (32, 256, 2, 4, 0, 1, 3), (16, 256, 2, 4, 0, 1, 2), (32, 128, 2, 4, 0, 1, 3),
              (32, 256, 2, 4, 0, 1), (16, 128, 2, 4, 0, 1, 2), (16, 256, 2, 3, 0, 1, 2)]
WIDE_IN = [(128, 128, 4, 4, 0, 2, 1), (128, 128, 4, 3, 0, 2, 1), (128, 128, 8, 4, 0, 2, 1), (64, 128, 4, 4, 0, 2, 1),
           (64, 128, 4, 3, 0, 2, 1), (64, 128, 4, 2, 0, 2, 1), (64, 64, 4, 4, 0, 2, 1), (128, 128, 8, 4, 0, 2, 2),
           (64, 128, 4, 3, 0, 2, 2), (64, 128, 4, 3, 0, 2, 3)]
# the LM head (tied, 16 or 64 rows): launched early with PDL, its first boxes loaded before the
# wait (TMA 2 preloads since round 9), or not
NARROW_LM = [(64, 128, 4, 4, 0, 2), (64, 128, 4, 4, 0, 2, 1), (64, 128, 4, 4, 0, 2, 2), (64, 128, 4, 4, 0, 2, 3),
             (64, 128, 8, 4, 0, 2, 2), (128, 128, 4, 4, 0, 2, 2), (64, 128, 4, 5, 0, 2, 2)]
WIDE_LM = [(64, 128, 4, 6, 0, 2), (64, 128, 4, 6, 0, 2, 1), (64, 128, 4, 6, 0, 2, 2)]
WIDE_OUT = [(32, 256, 4, 4, 0, 1), (32, 256, 4, 3, 0, 1), (16, 256, 2, 4, 0, 1), (32, 256, 2, 4, 0, 1),
            (64, 256, 4, 3, 0, 1), (16, 128, 2, 4, 0, 1, 1), (32, 128, 4, 4, 0, 1, 1), (16, 128, 4, 4, 0, 1, 1)]
SCAN = [{}, {"SCAN_WARPS": 8}, {"SCAN_WARPS": 4}, {"SCAN_BLOCK_S": 128}]
CONV_TILES = [(1, 128, 1), (2, 128, 1), (1, 256, 2), (2, 256, 2), (1, 512, 2), (4, 128, 2)]
"""ops/tree_conv/triton CONV_TILE settings (nodes, channels, warps) timed with --conv."""
# one-row GEMV (AR step) candidates, GemvConfig fields (block_n, block_k, warps, split, persistent,
# unroll, preload); block_k 0 with preload: the whole K (ops/gemv/triton.preload_blocks)
AR_OUT = [(1, 0, 4, 1, 0, False, True), (1, 0, 2, 1, 0, False, True), (2, 0, 4, 1, 0, False, True),
          (2, 0, 8, 1, 0, False, True), (4, 0, 4, 1, 0, False, True), (4, 0, 8, 1, 0, False, True),
          (8, 0, 8, 1, 0, False, True)]
AR_IN = [(1, 0, 2, 1, 0, False, True), (2, 0, 4, 1, 0, False, True), (1, 0, 8, 1, 0, False, True),
         (2, 0, 8, 1, 0, False, True), (4, 0, 8, 1, 0, False, True)]
"""Settings of ops/tree_scan/triton's knobs to time with the best projections ({}: the defaults)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1")
    ap.add_argument("--skip-projections", action="store_true", help="time only the current projection configs")
    ap.add_argument("--skip-scan", action="store_true", help="do not sweep the tree scan's knobs")
    ap.add_argument("--skip-pdl", action="store_true", help="do not time the projections launched with PDL")
    ap.add_argument("--ar", action="store_true", help="first tune the AR step's one-row GEMV configs")
    ap.add_argument("--conv", action="store_true", help="also time the tree conv's tiles (CONV_TILES)")
    for proj in ("in", "out", "lm"):
        ap.add_argument(f"--{proj}-candidates", default=None,
                        help=f"';'-separated configs replacing the {proj} projection's candidate lists ('none': skip it)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dispatch.set_backend("triton")
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    cache = prefilled_cache(model, prompt, 256)
    step = StepGraph(model, cache)
    ar_ms = median_ms(lambda: step(ids), iters=100)
    del step, cache
    print(f"{torch.cuda.get_device_name()}; {args.preset}; AR step {ar_ms:.3f} ms", flush=True)
    mixer = next(layer.mixer for layer in model.layers if layer.kind == "mamba")
    in_shape, out_shape = tuple(mixer.in_proj.weight.shape), tuple(mixer.out_proj.weight.shape)
    if args.ar:  # the one-row GEMV configs of the AR step, one projection at a time
        def step_ms() -> float:
            cache = prefilled_cache(model, prompt, 256)
            graph = StepGraph(model, cache)
            return median_ms(lambda: graph(ids), iters=200)

        saved_gemv = dict(gemv.TUNED)
        for shape, cands in ((out_shape, AR_OUT), (in_shape, AR_IN)):
            label = "in_proj" if shape == in_shape else "out_proj"
            best_cfg, best_ms = None, step_ms()
            print(f"  AR step, {label} GEMV current {saved_gemv.get(shape, 'default')}: {best_ms:.3f} ms", flush=True)
            for cfg in cands:
                gemv.TUNED[shape] = gemv.GemvConfig(*cfg)
                ms = step_ms()
                print(f"  AR step, {label} GEMV {cfg}: {ms:.3f} ms", flush=True)
                if ms < best_ms:
                    best_cfg, best_ms = cfg, ms
            gemv.TUNED.pop(shape, None)
            if best_cfg is not None:
                gemv.TUNED[shape] = gemv.GemvConfig(*best_cfg)
            elif shape in saved_gemv:
                gemv.TUNED[shape] = saved_gemv[shape]
            print(f"  AR step best {label}: {best_cfg or 'default'} {best_ms:.3f} ms", flush=True)
        gemv.TUNED.clear()
        gemv.TUNED.update(saved_gemv)
    summary = []

    def timed(label: str) -> float:
        try:
            ms = time_tree_iteration(model, prompt, tree, vocab)["ms"]
        except Exception as e:  # noqa: BLE001 -- a config the compiler rejects
            print(f"  {tree.num_nodes} nodes {label}: failed {e!r}"[:200], flush=True)
            return float("inf")
        print(f"  {tree.num_nodes} nodes {label}: {ms:.3f} ms = {ms / ar_ms:.3f}x AR", flush=True)
        return ms

    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        wide = tree.num_nodes > gemv.SKINNY_MAX_ROWS
        table = gemv.SKINNY_WIDE if wide else gemv.SKINNY_TUNED
        saved = copy.deepcopy(table)
        lm_shape = tuple(model.lm_head.weight.shape)
        best = {in_shape: saved.get(in_shape), out_shape: saved.get(out_shape), lm_shape: saved.get(lm_shape)}
        base = timed(f"current in {best[in_shape]} out {best[out_shape]} lm_head {best[lm_shape]}")
        best_ms = base
        def candidates(given, listed):
            if given is None:
                return listed
            return [tuple(int(v) for v in c.split(",")) for c in given.split(";") if c and given != "none"]

        sweeps = [] if args.skip_projections else [
            (out_shape, candidates(args.out_candidates, WIDE_OUT if wide else NARROW_OUT)),
            (in_shape, candidates(args.in_candidates, WIDE_IN if wide else NARROW_IN)),
            (lm_shape, candidates(args.lm_candidates, WIDE_LM if wide else NARROW_LM))]
        for shape, cands in sweeps:
            for cfg in cands:
                if cfg == best[shape]:
                    continue
                table.update({k: v for k, v in best.items() if v is not None})
                table[shape] = cfg
                label = {in_shape: "in_proj", out_shape: "out_proj", lm_shape: "lm_head"}[shape]
                ms = timed(f"{label} {cfg}")
                if ms < best_ms:
                    best_ms, best[shape] = ms, cfg
        if sweeps:  # the table's entries once more, for the spread between timings of one config
            table.clear()
            table.update(saved)
            timed("current again")
        table.update({k: v for k, v in best.items() if v is not None})
        defaults = {name: getattr(scan, name) for setting in SCAN for name in setting}
        for setting in [] if args.skip_scan else SCAN:  # the scan's knobs with the best projections
            for name, value in {**defaults, **setting}.items():
                setattr(scan, name, value)
            timed(f"scan {setting or 'defaults'}")
        for name, value in defaults.items():
            setattr(scan, name, value)
        for tile in CONV_TILES if args.conv else []:
            conv.CONV_TILE = tile
            timed(f"tree conv tile {tile}")
        conv.CONV_TILE = None
        names = {in_shape: "in_proj", out_shape: "out_proj", lm_shape: "lm_head"}
        current = {s_: table.get(s_) or gemv.SKINNY_DEFAULT for s_ in names}
        for flags in ([] if args.skip_pdl else [{in_shape: 1, out_shape: 0}, {in_shape: 1, out_shape: 1},
                                                 {in_shape: 1, out_shape: 2}, {in_shape: 1, out_shape: 3}]):
            for s_, cfg in current.items():  # the seventh entry: launched early with PDL
                cfg = (tuple(cfg) + (0, 0, 0))[:6] + (flags.get(s_, (tuple(cfg) + (0,) * 7)[6]),)
                table[s_] = cfg
            timed("PDL " + ", ".join(f"{names[s_]} {v}" for s_, v in flags.items()))
        table.clear()
        table.update(saved)
        summary.append((tree.num_nodes, base, best_ms, best[in_shape], best[out_shape], best[lm_shape]))
    print(f"\n{'nodes':>5} {'current ms':>10} {'best ms':>8} {'x AR':>6}  best (in_proj, out_proj, lm_head)")
    for nodes, base, ms, cin, cout, clm in summary:
        print(f"{nodes:>5} {base:10.3f} {ms:8.3f} {ms / ar_ms:6.3f}  {cin}, {cout}, {clm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
