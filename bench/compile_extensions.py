"""Compile the one-launch CUDA extensions (ops/stream_layers, ops/stream_proj) with nvcc as torch's
loader would, flags and macros included, on a machine without a GPU: catches a compile error before
a GPU session pays for it (a template parameter that a -D macro of the loader's flags replaced
once compiled without the flags, and failed on the GPU with them).

Needs nvcc (Hopper support) and torch's headers. The CUDA math-library headers that torch's
extension header includes but the kernels never use (a CUDA toolkit without cuBLAS, cuSPARSE and
cuSOLVER) are stubbed when missing, with the handle and status types that torch's headers name.

    python3 bench/compile_extensions.py                          # both extensions at d_model 256 and 2560
    python3 bench/compile_extensions.py --d-models 768,1024,1536,2048   # the other mamba2 presets' shapes
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from ssmspec.ops.stream_layers import cuda as stream_layers  # noqa: E402
from ssmspec.ops.stream_proj import cuda as stream_proj  # noqa: E402

TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")
COMMON = ["-c", "-std=c++17", "--expt-relaxed-constexpr", "--compiler-options", "-fPIC",
          "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
          "-D__CUDA_NO_HALF2_OPERATORS__", "-DTORCH_EXTENSION_NAME=check", "-DTORCH_API_INCLUDE_EXTENSION_H",
          "-isystem", TORCH_INCLUDE, "-isystem", os.path.join(TORCH_INCLUDE, "torch/csrc/api/include"),
          "-isystem", sysconfig.get_paths()["include"]]


STUBS = {  # header -> what torch's CUDA context headers need of it
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t; typedef enum {CUBLAS_STATUS_SUCCESS=0} cublasStatus_t;",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;",
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t; typedef enum {CUSPARSE_STATUS_SUCCESS=0} "
                  "cusparseStatus_t; static inline const char* cusparseGetErrorString(cusparseStatus_t) { return \"\"; }",
    "cusolver_common.h": "typedef struct cusolverDnContext* cusolverDnHandle_t; typedef enum {CUSOLVER_STATUS_SUCCESS=0} "
                         "cusolverStatus_t;",
    "cusolverDn.h": "#include <cusolver_common.h>",
}


def jobs(work: str, d_models: list[int]) -> list[tuple[str, list[str]]]:
    """(label, nvcc arguments) of each build: the flags of the two `_module`s' load_inline calls
    (expand 2, head dim 64, d_state 128, one group)."""
    ops = os.path.join(ROOT, "ssmspec", "ops")
    out = []
    for d_model in d_models:
        n_heads = 2 * d_model // 64
        src = os.path.join(work, f"stream_layers_{d_model}.cu")
        with open(os.path.join(ops, "stream_layers", "kernel.cu")) as f, open(src, "w") as g:
            g.write(f.read() + stream_layers._LAUNCHER)
        flags = stream_layers.nvcc_flags(d_model, n_heads, 64, 4, True)
        out.append((f"stream_layers d_model {d_model}", flags + ["-I", os.path.join(ops, "stream_layers"), src]))
        n_in = 4 * d_model + 2 * 128 + n_heads
        src = os.path.join(work, f"stream_proj_{d_model}.cu")
        with open(os.path.join(ops, "stream_proj", "kernel.cu")) as f, open(src, "w") as g:
            g.write(f.read() + stream_proj._LAUNCHER)
        flags = stream_proj.nvcc_flags(d_model, 2 * d_model, n_in, stream_proj.SLOTS, stream_proj.IN_FLIGHT)
        out.append((f"stream_proj d_model {d_model}",
                    flags + ["-I", os.path.join(ops, "stream_proj"), "-I", os.path.join(ops, "stream_layers"), src]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-models", default="256,2560", help="comma-separated d_model values")
    args = ap.parse_args()
    if shutil.which("nvcc") is None:
        print("needs nvcc")
        return 2
    with tempfile.TemporaryDirectory() as work:
        stubs = os.path.join(work, "stubs")
        os.makedirs(stubs)
        failed = 0
        for label, nvcc_args in jobs(work, [int(d) for d in args.d_models.split(",")]):
            while True:  # stub each missing library header, then compile again
                cmd = ["nvcc", *COMMON, "-I", stubs, *nvcc_args, "-o", os.path.join(work, "out.o")]
                run = subprocess.run(cmd, capture_output=True, text=True)
                missing = re.search(r"fatal error: ([\w/.]+\.h): No such file", run.stdout + run.stderr)
                if run.returncode == 0 or not missing:
                    break
                path = os.path.join(stubs, missing.group(1))
                if os.path.exists(path):
                    break
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write("#pragma once\n" + STUBS.get(missing.group(1), "") + "\n")
            errors = [line for line in (run.stdout + run.stderr).splitlines() if "error" in line]
            print(f"{label:<32} {'ok' if run.returncode == 0 else 'FAILED'}", *errors[:8], sep="\n  " if errors else "",
                  flush=True)
            failed += run.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
