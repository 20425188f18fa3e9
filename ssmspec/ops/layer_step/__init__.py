"""One folded Mamba-2 sublayer at batch 1: h + out_proj(step(in_proj(rms_norm(h))))."""
from .naive import naive_mamba_layer_step

__all__ = ["naive_mamba_layer_step"]
