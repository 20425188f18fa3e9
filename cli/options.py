"""Option types shared by several commands, so each flag reads and validates the same way."""
from __future__ import annotations

import typer

DTYPE = typer.Option(None, "--dtype", help="Parameter dtype: fp32, bf16 or fp16 (default: the checkpoint's).")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda, cuda:N, or auto (CUDA when available).")
BACKEND = typer.Option("auto", "--backend", help="Kernels: auto (Triton on CUDA, and on Hopper the one-launch CUDA "
                       "kernels where the model fits; SSMSPEC_STREAM_LAYERS=0 keeps Triton only), reference (plain torch) "
                       "or triton.")
SEED = typer.Option(None, "--seed", help="Random seed for sampling (default 0).")
