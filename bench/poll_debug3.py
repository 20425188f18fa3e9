"""Debug: where polled and waiting decode steps first differ (layer, state), 64 layers."""
import torch
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch
from ssmspec.ops.step_update import triton as SU

torch.manual_seed(0)
model = build_model("mamba2-2.7b", dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
dispatch.set_backend("triton")
prompt = torch.randint(0, 1000, (1, 8), device="cuda")
caches = {}
for polled in (False, True):
    SU.POLLED_STEP = polled
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(prompt, cache)
    caches[polled] = cache
tok = prompt[:, -1:]
with torch.inference_mode():
    for step in range(4):
        for polled in (False, True):
            SU.POLLED_STEP = polled
            model.step(tok, caches[polled])
            torch.cuda.synchronize()
        diffs = []
        for l, (a, b) in enumerate(zip(caches[False].layers, caches[True].layers)):
            dc = (a.conv_state.float() - b.conv_state.float()).abs()
            ds = (a.ssm_state - b.ssm_state).abs()
            if dc.max() > 0 or ds.max() > 0:
                ch = (dc.amax(-1) > 0).nonzero()[:, 1]
                diffs.append((l, float(dc.max()), float(ds.max()), ch[:6].tolist(), int(ch.numel())))
        print("step", step, "differing layers:", len(diffs), diffs[:3], flush=True)
