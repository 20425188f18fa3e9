"""The whole Mamba-2 layer stack of a batch-1 decode step in one persistent CUDA kernel.

`kernel.cu` streams every layer's weights through shared memory while the phases of each layer
meet at grid barriers (see its header); `cuda.py` builds it for a model's shape with torch's C++
extension loader (nvcc and ninja, Hopper only) and states what it supports (`unsupported_reason`).
ops/paths.py decides where it runs in `LanguageModel.step`'s place (`SSMSPEC_STREAM_LAYERS`:
unset or auto, the default; 1 to be told why not; 0 for the Triton kernels only). Trees of up to
16 nodes then get the same design for the verify's projections (ops/stream_proj). The reference
for its tests is the Triton path (`tests/gpu/test_stream_layers_gpu.py`). `fragments.cuh` holds
the A-fragment helpers that ops/stream_proj shares.
"""
from ..settings import stream_layers_mode as mode
from .cuda import StreamLayers, unsupported_reason

__all__ = ["StreamLayers", "mode", "unsupported_reason"]
