// Host side of the weight-stream kernels' launches (ops/stream_layers, ops/stream_proj): one CTA per
// SM on torch's current stream, with programmatic dependent launch when asked (ops/pdl.py).
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

template <typename... Params, typename... Args>
void launch_one_cta_per_sm(void (*kernel)(Params...), int threads, int64_t smem, bool pdl, Args... args) {
  static int64_t configured = -1;  // the dynamic shared-memory limit, set once per kernel and size
  if (configured != smem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    configured = smem;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}
