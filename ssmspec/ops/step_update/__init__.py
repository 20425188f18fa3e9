"""The single-token Mamba-2 step between in_proj and out_proj, fused: conv + state update + gated norm."""
from .naive import (
    naive_add_rms_norm,
    naive_gated_rms_norm,
    naive_mamba_step,
    naive_mamba_step_out,
    naive_rms_norm,
    naive_time_step,
)

__all__ = ["naive_add_rms_norm", "naive_gated_rms_norm", "naive_mamba_step", "naive_mamba_step_out", "naive_rms_norm",
           "naive_time_step"]
