"""Debug: the polled sublayer step at the 2.7b shape, eagerly, one call at a time (hang/compare)."""
import sys
import torch
from ssmspec.ops.step_update import triton as SU

H, P, S, K = 80, 64, 128, 4
torch.manual_seed(0)
bf = torch.bfloat16
d_model, rows = 2560, 2 * H * P + 2 * S + H
W = torch.randn(rows, d_model, device="cuda", dtype=bf) / 50
layer = (torch.randn(H * P + 2 * S, K, device="cuda", dtype=bf) / 2, torch.randn(H * P + 2 * S, device="cuda", dtype=bf),
         torch.randn(H, device="cuda") * 0.5 - 3, torch.randn(H, device="cuda"), torch.randn(H, device="cuda"), 1, 1,
         0.0, float("inf"), 1e-5, torch.randn(d_model, H * P, device="cuda", dtype=bf) / 70, None)
conv0 = torch.randn(1, H * P + 2 * S, K - 1, device="cuda", dtype=bf)
ssm0 = torch.randn(1, H, P, S, device="cuda")
h = torch.randn(1, d_model, device="cuda", dtype=bf)
for polled in (False, True):
    SU.POLLED_STEP = polled
    conv, ssm, buffers = conv0.clone(), ssm0.clone(), {}
    outs = []
    for i in range(3):
        outs.append(SU.mamba_sublayer_step(h, W, None, 1e-5, conv, ssm, *layer, buffers=buffers))
        torch.cuda.synchronize()
        print("polled", polled, "call", i, "done", flush=True)
    work = [t for t in buffers.values() if torch.is_tensor(t)]
    print("buffers", len(work), [int(w.view(torch.int16).ne(-1).sum()) for w in work], flush=True)
    if not polled:
        ref = outs
    else:
        print("equal", [torch.equal(a, b) for a, b in zip(outs, ref)],
              [float((a.float() - b.float()).abs().max()) for a, b in zip(outs, ref)], flush=True)
