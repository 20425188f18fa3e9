"""Debug: the polled step inside a whole model (eager), layer counts 2, 8, 64, with a watchdog."""
import sys
import torch
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch
from ssmspec.ops.step_update import triton as SU

n_layers = int(sys.argv[1])
torch.manual_seed(0)
model = build_model("mamba2-2.7b", dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
model.layers = model.layers[:n_layers]
dispatch.set_backend("triton")
prompt = torch.randint(0, 1000, (1, 8), device="cuda")
res = {}
for polled in (False, True, False, True):
    SU.POLLED_STEP = polled
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(prompt, cache)
        tok = prompt[:, -1:]
        outs = []
        for i in range(6):
            logits = model.step(tok, cache)
            torch.cuda.synchronize()
            outs.append(logits.clone())
    if polled in res:
        print(f"polled {polled} vs its first run:", [torch.equal(a, b) for a, b in zip(outs, res[polled])],
              [float((a - b).abs().max()) for a, b in zip(outs, res[polled])], flush=True)
    else:
        res[polled] = outs
print("polled vs waiting", [torch.equal(a, b) for a, b in zip(res[True], res[False])],
      [float((a - b).abs().max()) for a, b in zip(res[True], res[False])], flush=True)
