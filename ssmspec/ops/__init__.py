"""Kernels: one folder per op, `naive.py` is the plain-torch reference, `triton.py` the GPU kernel."""
