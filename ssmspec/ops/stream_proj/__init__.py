"""The tree verify's Mamba projections at up to 16 nodes on the weight stream, in CUDA.

`kernel.cu` runs one layer's out_proj and the next layer's in_proj in one launch, one CTA per SM
streaming whole weight rows through shared memory (the design of ops/stream_layers); the tree conv
and the gated scan stay the Triton kernels between launches. `cuda.py` builds it for a model's
shape (nvcc and ninja, Hopper only). In the mode of the one-launch decode step (ops/stream_layers:
the default; `SSMSPEC_STREAM_LAYERS=0` turns both off) `LanguageModel.verify` takes it for trees of
up to 16 nodes; its reference is the Triton path (`tests/gpu/test_stream_proj_gpu.py`).
"""
from .cuda import MAX_NODES, StreamProj, unsupported_reason

__all__ = ["MAX_NODES", "StreamProj", "unsupported_reason"]
