"""mamba_ssm's batch-1 decode against ssmspec's in one process, same shape and same weights.

Per-token times, as ratios to the weight-read floor and to ssmspec's AR step (issue 3's baseline).

mamba_ssm is never a dependency of ssmspec. This script imports its pure-Python sources from a
git-ignored folder, `.baseline/` at the repository root (or --baseline-dir), made once with:

    MAMBA_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-build-isolation mamba-ssm==2.2.4 -d /tmp/x
    tar -xzf /tmp/x/mamba_ssm-2.2.4.tar.gz -C /tmp/x      # the sdist
    mkdir -p .baseline && cp -r /tmp/x/mamba_ssm-2.2.4/{mamba_ssm,LICENSE} .baseline/

Nothing of it is compiled or edited: its CUDA extension `selective_scan_cuda` (Mamba-1 prefill
only) is replaced by a stub module that raises when called, transformers 5's missing
GreedySearchDecoderOnlyOutput / SampleDecoderOnlyOutput by a small dataclass, and causal_conv1d
is absent, so mamba_ssm runs the conv of its decode step in plain torch (its own fallback, the
configuration of the issue's 5.09 ms/token anchor) and everything else in its Triton kernels
(selective_state_update, fused add + RMSNorm, gated RMSNorm, the SSD chunk scan for prefill).
Its run-time needs are torch, triton, einops, transformers and huggingface_hub.

Run on a CUDA machine from the repository root, with ssmspec installed (`pip install --no-deps
--no-build-isolation -e .`, as bench/gpu_round.sh does); on the device tool pass
carry [".baseline"]. About 2-4 minutes on an H100, most of it Triton compiling and autotuning:

    python bench/bench_mamba_ssm.py --preset mamba2-2.7b --out bench_mamba_ssm.json

Both models have the same random bf16 weights (ssmspec's preset, copied into mamba_ssm's
MambaLMHeadModel before ssmspec folds its norm weights). Rows, all CUDA-event medians after
warm-up:
  - ssmspec's AR step as a CUDA graph (StepGraph, folded norms, fp32 SSM state) in the mode the
    environment sets: by default, on Hopper with nvcc, the one-launch kernel (bench_decode.py's
    one-launch AR row); with SSMSPEC_STREAM_LAYERS=0 the Triton kernels (its folded AR row);
  - mamba_ssm's own single-step CUDA graph (utils.generation.capture_graph, the runner its
    generate(cg=True) replays per token: it also fills lengths_per_sample, copies the token and
    clones the logits), with an fp32 SSM state (comparable to ssmspec) and with the bf16 state
    that its generate allocates;
  - mamba_ssm's generate per token with and without CUDA graphs (greedy), as
    (time of prompt + 1 + N tokens - time of prompt + 1 token) / N, so prefill cancels.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import sys
import traceback
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS: dict = {}


def _stub_selective_scan_cuda() -> None:
    """A stand-in for mamba_ssm's unbuilt CUDA extension: importable, raises when used."""
    if "selective_scan_cuda" in sys.modules or importlib.util.find_spec("selective_scan_cuda") is not None:
        return
    stub = types.ModuleType("selective_scan_cuda")

    def missing(name: str):
        if name.startswith("__"):  # keep introspection (inspect, pickling) working
            raise AttributeError(name)

        def call(*args, **kwargs):
            raise RuntimeError(f"selective_scan_cuda.{name}: mamba_ssm's CUDA extension is not built here "
                               "(a stub from bench_mamba_ssm.py); only Mamba-1 prefill needs it")

        return call

    stub.__getattr__ = missing
    sys.modules["selective_scan_cuda"] = stub


@dataclasses.dataclass
class _DecoderOnlyOutput:
    """What mamba_ssm's decode builds its result from (sequences (B, T), scores)."""

    sequences: torch.Tensor
    scores: tuple | None = None


def _shim_transformers() -> None:
    """transformers 5 dropped the output classes that mamba_ssm.utils.generation imports."""
    from transformers import generation

    for name in ("GreedySearchDecoderOnlyOutput", "SampleDecoderOnlyOutput"):
        try:
            getattr(generation, name)
        except (AttributeError, ImportError):
            setattr(generation, name, _DecoderOnlyOutput)


def import_mamba_ssm(baseline_dir: Path) -> dict:
    """Import mamba_ssm from baseline_dir (first on sys.path) with the two shims; returns its
    entry points and a description of the configuration it runs in."""
    if not (baseline_dir / "mamba_ssm" / "__init__.py").is_file():
        raise SystemExit(f"no mamba_ssm sources in {baseline_dir}: make them as this script's docstring says, "
                         "or point --baseline-dir at the folder that holds mamba_ssm/")
    sys.path.insert(0, str(baseline_dir))
    _stub_selective_scan_cuda()
    _shim_transformers()
    import mamba_ssm
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    from mamba_ssm.modules import mamba2
    from mamba_ssm.utils.generation import InferenceParams, capture_graph

    config = {
        "mamba_ssm": f"{mamba_ssm.__version__} from {Path(mamba_ssm.__file__).parent}",
        "causal_conv1d": "absent: conv step in torch (mamba_ssm's fallback)" if mamba2.causal_conv1d_update is None
        else "installed: causal_conv1d_update kernel",
        "selective_state_update": "Triton" if mamba2.selective_state_update is not None else "absent: torch einsum fallback",
        "selective_scan_cuda": "stub" if getattr(sys.modules["selective_scan_cuda"], "__file__", None) is None else "built",
    }
    return {"MambaConfig": MambaConfig, "MambaLMHeadModel": MambaLMHeadModel, "InferenceParams": InferenceParams,
            "capture_graph": capture_graph, "config": config}


def mamba_ssm_config(ms: dict, preset: str):
    """mamba_ssm's MambaConfig for a pure Mamba-2 ssmspec preset (the same shape)."""
    from ssmspec.models.presets import PRESETS, preset_config

    cfg = preset_config(preset)
    if not cfg.is_pure_mamba:
        raise SystemExit(f"{preset} is not a pure Mamba-2 preset; the mamba_ssm comparison covers "
                         f"{', '.join(n for n in PRESETS if preset_config(n).is_pure_mamba)}")
    m = cfg.mamba
    if m.d_inner % cfg.d_model:
        raise SystemExit(f"{preset}: d_inner {m.d_inner} is not a multiple of d_model {cfg.d_model} (mamba_ssm's expand)")
    ssm_cfg = {"layer": "Mamba2", "d_state": m.d_state, "d_conv": m.conv_kernel, "expand": m.d_inner // cfg.d_model,
               "headdim": m.head_dim, "ngroups": m.n_groups, "chunk_size": m.chunk_size,
               "bias": m.proj_bias, "conv_bias": m.conv_bias}
    # cfg.vocab_size is already padded to a multiple of 16 (mamba2-*: GPT-NeoX's 50277 -> 50288,
    # as mamba_ssm pads it), so mamba_ssm's own padding leaves it alone.
    return ms["MambaConfig"](d_model=cfg.d_model, n_layer=len(cfg.layers), vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                             rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
                             tie_embeddings=cfg.tie_embeddings)


def copy_weights(ours, theirs) -> list[str]:
    """Load ssmspec's (unfolded) weights into mamba_ssm's model; returns the keys that did not
    match (empty when both compute the same function)."""
    def their_name(key: str) -> str:
        if key.startswith("lm_head."):
            return key
        return "backbone." + ("embedding." + key[len("embeddings."):] if key.startswith("embeddings.") else key)

    state = {their_name(k): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    return [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]


def timed_ms(fn) -> float:
    """Wall time of one fn() call by CUDA events, from an idle device."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def generate_ms_per_token(model, prompt: torch.Tensor, new_tokens: int, cg: bool, reps: int) -> float:
    """Per-token time of mamba_ssm's greedy generate: median(prompt + 1 + N) - median(prompt + 1), over N."""
    length = prompt.shape[1]

    def generate(n: int):
        return model.generate(prompt, max_length=length + n, cg=cg, top_k=1)

    # The long run first: generate(cg=True) captures its graph for the largest max_length it has
    # seen and recaptures only for a larger one.
    generate(1 + new_tokens)
    generate(1)
    long_runs, short_runs = [], []
    for _ in range(reps):
        long_runs.append(timed_ms(lambda: generate(1 + new_tokens)))
        short_runs.append(timed_ms(lambda: generate(1)))
    long_runs.sort()
    short_runs.sort()
    return (long_runs[reps // 2] - short_runs[reps // 2]) / new_tokens


def their_prefilled_params(ms: dict, model, prompt: torch.Tensor, max_len: int, state_dtype: torch.dtype):
    """mamba_ssm's InferenceParams after prefilling prompt, with the SSM state in state_dtype
    (its generate allocates it in the weights' dtype); the next forward call is a decode step."""
    cache = model.allocate_inference_cache(prompt.shape[0], max_len, dtype=torch.bfloat16)
    if state_dtype != torch.bfloat16:
        cache = {i: (conv, torch.zeros_like(ssm, dtype=state_dtype)) for i, (conv, ssm) in cache.items()}
    params = ms["InferenceParams"](max_seqlen=max_len, max_batch_size=prompt.shape[0], key_value_memory_dict=cache,
                                   lengths_per_sample=torch.zeros(prompt.shape[0], dtype=torch.int32, device="cuda"))
    model(prompt, inference_params=params, num_last_tokens=1)
    params.seqlen_offset = prompt.shape[1]
    params.lengths_per_sample[:] = prompt.shape[1]
    return params


def our_step_graph(ours, prompt: torch.Tensor, ids: torch.Tensor, iters: int) -> tuple[float, torch.Tensor]:
    """bench_decode's folded AR row: StepGraph replays after prefilling prompt. Returns the median
    ms and the logits (1, 1, V) of the first step after the prompt."""
    from bench_decode import median_ms, prefilled_cache

    from ssmspec.decoding.graphs import StepGraph

    cache = prefilled_cache(ours, prompt, 256)
    graph = StepGraph(ours, cache)
    logits = graph(ids).clone()
    return median_ms(lambda: graph(ids), iters=iters), logits


def their_step_graph_ms(ms: dict, model, prompt: torch.Tensor, ids: torch.Tensor, max_len: int,
                        state_dtype: torch.dtype, iters: int) -> float:
    """Median ms of mamba_ssm's captured decode step (capture_graph's runner, as generate(cg=True)
    calls it per token) after prefilling prompt."""
    from bench_decode import median_ms

    params = their_prefilled_params(ms, model, prompt, max_len, state_dtype)
    run = ms["capture_graph"](model, params, prompt.shape[0], max_len, decoding_seqlen=1)
    length = prompt.shape[1]
    position = torch.full((prompt.shape[0], 1), length, dtype=torch.long, device="cuda")
    return median_ms(lambda: run(ids, position, length), iters=iters)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b", help="a pure Mamba-2 preset (mamba2-*, tiny, drafter-2l)")
    ap.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per timed generate(cg=True)")
    ap.add_argument("--nograph-tokens", type=int, default=16, help="decoded tokens per timed generate(cg=False)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=100, help="graph replays per step median")
    ap.add_argument("--reps", type=int, default=5, help="generate runs per length (cg=True; 3 for cg=False)")
    ap.add_argument("--skip-nograph", action="store_true", help="skip mamba_ssm's generate without CUDA graphs (~50 ms/token)")
    ap.add_argument("--baseline-dir", type=Path, default=REPO / ".baseline", help="folder holding mamba_ssm/")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mamba_ssm.py times CUDA graphs and needs a CUDA GPU; none is visible here.", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO / "bench"))  # bench_decode's helpers, also when not run as a script
    import transformers
    import triton
    from bench_decode import copy_bandwidth, param_bytes

    from ssmspec.models.presets import build_model
    from ssmspec.ops import dispatch, paths

    ms = import_mamba_ssm(args.baseline_dir.resolve())
    their_cfg = mamba_ssm_config(ms, args.preset)

    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    versions = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}
    RESULTS.update(device=dev, preset=args.preset, versions=versions, mamba_ssm_config=ms["config"],
                   mamba_ssm_model=dataclasses.asdict(their_cfg), stream_layers_mode=paths.stream_layers_mode())
    print(dev, ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    print("mamba_ssm configuration: " + "; ".join(f"{k}: {v}" for k, v in ms["config"].items()), flush=True)

    bw = copy_bandwidth()
    ours = build_model(args.preset, dtype=torch.bfloat16, device="cuda")
    nbytes = param_bytes(ours)
    floor_ms = nbytes / bw * 1000
    theirs = ms["MambaLMHeadModel"](their_cfg, device="cuda", dtype=torch.bfloat16).eval()
    their_bytes = param_bytes(theirs)
    mismatched = copy_weights(ours, theirs)  # before folding: the same function in both
    RESULTS.update(param_bytes=nbytes, mamba_ssm_param_bytes=their_bytes, copy_bw_TBps=bw / 1e12, floor_ms=floor_ms,
                   weight_copy_mismatches=mismatched)
    print(f"{args.preset}: {nbytes / 1e9:.3f} GB of weights (mamba_ssm's model: {their_bytes / 1e9:.3f} GB); "
          f"copy {bw / 1e12:.2f} TB/s -> floor {floor_ms:.3f} ms", flush=True)
    if mismatched:
        print(f"  weights NOT shared ({len(mismatched)} keys differ, e.g. {mismatched[:4]}): timings still valid, "
              "logits not comparable", flush=True)
    ours.fold_norm_weights_()
    dispatch.set_backend("triton")

    vocab = ours.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    max_len = args.prompt_len + 2 + max(args.new_tokens, args.nograph_tokens)

    ours_ms, our_logits = our_step_graph(ours, prompt, ids, args.iters)
    rows = [{"what": f"ssmspec AR step graph (folded, fp32 state; one-launch {paths.stream_layers_mode()})",
             "ms": ours_ms}]
    print(f"  {rows[0]['what']:<64} {ours_ms:8.3f} ms", flush=True)
    del ours  # and its graph: only the logits are kept
    gc.collect()
    torch.cuda.empty_cache()

    def record(name: str, fn):
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - one failed mamba_ssm row must not lose the others of a device run
            print(f"  {name:<64} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}", flush=True)
            rows.append({"what": name, "ms": None, "error": f"{type(e).__name__}: {e}"})
            return
        rows.append({"what": name, "ms": value})
        print(f"  {name:<64} {value:8.3f} ms", flush=True)

    with torch.inference_mode():
        if not mismatched:
            def compare_logits():
                params = their_prefilled_params(ms, theirs, prompt, max_len, torch.float32)
                their_logits = theirs(ids, inference_params=params, num_last_tokens=1).logits
                a, b = our_logits.double().flatten(), their_logits.double().flatten()
                rel = ((a - b).norm() / b.norm()).item()
                same = bool(a.argmax() == b.argmax())
                RESULTS.update(step_logits_rel_err=rel, step_logits_same_argmax=same)
                print(f"  step logits, ssmspec vs mamba_ssm (same weights and prompt, fp32 states): rel err {rel:.2e}, "
                      f"same argmax {same}", flush=True)

            try:
                compare_logits()
            except Exception as e:  # noqa: BLE001 - the timings below do not depend on it
                print(f"  step logits comparison FAILED: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}", flush=True)
                RESULTS["step_logits_error"] = f"{type(e).__name__}: {e}"

        for state_dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            record(f"mamba_ssm step, CUDA graph (capture_graph runner, {label} state)",
                   lambda dtype=state_dtype: their_step_graph_ms(ms, theirs, prompt, ids, max_len, dtype, args.iters))
            gc.collect()  # frees the graph and its states
            torch.cuda.empty_cache()
        record(f"mamba_ssm generate(cg=True) per token (bf16 state, {args.new_tokens} tokens)",
               lambda: generate_ms_per_token(theirs, prompt, args.new_tokens, cg=True, reps=args.reps))
        if not args.skip_nograph:
            record(f"mamba_ssm generate(cg=False) per token (bf16 state, {args.nograph_tokens} tokens)",
                   lambda: generate_ms_per_token(theirs, prompt, args.nograph_tokens, cg=False, reps=3))

    for r in rows:
        if r["ms"] is not None:
            r["x_floor"] = r["ms"] / floor_ms
            r["x_ours"] = r["ms"] / ours_ms
    RESULTS["rows"] = rows

    print(f"\n{dev}; {args.preset} random bf16 weights (the same in both), batch 1; x ours = over ssmspec's AR step graph")
    print(f"weight-read floor {floor_ms:.3f} ms ({nbytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)")
    print("mamba_ssm: " + "; ".join(f"{k}: {v}" for k, v in ms["config"].items()))
    print(f"{'what':<66} {'ms/token':>9} {'x floor':>8} {'x ours':>7}")
    print(f"{'weight-read floor':<66} {floor_ms:9.3f} {1.0:8.2f} {floor_ms / ours_ms:7.2f}")
    for r in rows:
        if r["ms"] is None:
            print(f"{r['what']:<66} {'failed':>9}")
        else:
            print(f"{r['what']:<66} {r['ms']:9.3f} {r['x_floor']:8.2f} {r['x_ours']:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
