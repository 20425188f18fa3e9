"""Debug: the polled step inside a captured StepGraph (hang check), and its timing against waiting."""
import sys
import time
import torch
from ssmspec.decoding.graphs import StepGraph
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch
from ssmspec.ops.step_update import triton as SU

n_layers = int(sys.argv[1])
torch.manual_seed(0)
model = build_model("mamba2-2.7b", dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
model.layers = model.layers[:n_layers]
dispatch.set_backend("triton")
prompt = torch.randint(0, 1000, (1, 8), device="cuda")
ids = prompt[:, -1:]
for polled in (True, False, True, False):
    SU.POLLED_STEP = polled
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(prompt, cache)
    print(f"layers {n_layers} polled {polled}: capturing", flush=True)
    g = StepGraph(model, cache)
    print("  captured", flush=True)
    for i in range(3):
        g(ids)
        torch.cuda.synchronize()
    times = []
    for i in range(50):
        torch.cuda._sleep(200_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g(ids); e.record(); e.synchronize()
        times.append(s.elapsed_time(e))
    print(f"  replays ok, median {sorted(times)[25]:.3f} ms", flush=True)
    del g
