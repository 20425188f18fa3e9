"""The whole Mamba-2 layer stack of a batch-1 decode step in one persistent CUDA kernel.

`kernel.cu` streams every layer's weights through shared memory while the phases of each layer
meet at grid barriers (see its header and docs/BENCHMARKS.md, round 11); `cuda.py` builds it for
a model's shape with torch's C++ extension loader (nvcc and ninja, Hopper only) and runs it in
`LanguageModel.step`'s place for the layers. Opt-in (`SSMSPEC_STREAM_LAYERS=1`): the Triton
path stays the default until the tree verify has the same design, and the reference for its
tests is that path (`tests/gpu/test_stream_layers_gpu.py`).
"""
from .cuda import StreamLayers, enabled, unsupported_reason

__all__ = ["StreamLayers", "enabled", "unsupported_reason"]
