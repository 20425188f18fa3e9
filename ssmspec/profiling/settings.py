"""What `ssmspec profile` measures: ProfileSettings, the one home of its defaults, and the CLI's parsers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ssmspec.trees.tree import MAX_TREE_NODES

from ..errors import InputError
from .fits import MIN_FIT_SIZES


METHODS = ("stree", "unrolled", "chain")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CONFIGS = ((3, 2, 2, 1), (3, 3, 2, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1))
"""Tree configurations timed for the drafter by default (the mamba-drafters paper's table 6)."""

ProgressFn = Callable[[str, int, int], None]
"""progress(label, done, total): called before each timed item and once at the end."""


@dataclass
class ProfileSettings:
    """What `run_profile` measures and how."""

    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Input sizes N (packed tokens per target call); 1 is the autoregressive step."""
    methods: tuple[str, ...] = METHODS
    """Any of stree, unrolled, chain."""
    batch: int = 1
    """Independent sequences per call (rows of the cache)."""
    repeats: int = 10
    """Timed calls per measurement (the median is reported)."""
    warmup: int = 3
    """Untimed calls before each measurement."""
    prompt_len: int = 128
    """Tokens prefilled into the cache before timing."""
    fanout: int = 2
    """Children per node of the balanced tree used for stree and unrolled."""
    cuda_graphs: bool = True
    """Capture each timed call into a CUDA graph when on CUDA and the call allows it."""
    threads: int | None = None
    """CPU threads while timing on the CPU; None: `timing.default_cpu_threads()` (1 unless OMP_NUM_THREADS is set)."""
    reference_n: int = 5
    """N1 of the break-even ratio t(N2) / t(N1) (5, as in the STree paper)."""
    configs: tuple[tuple[int, ...], ...] = DEFAULT_CONFIGS
    """Tree configurations whose drafting time is measured (needs a drafter)."""
    seed: int = 0

    def validate(self) -> None:
        bad = [n for n in self.sizes if not isinstance(n, int) or n < 1]
        if bad:
            raise InputError(f"sizes must be positive integers, got {bad}")
        if max(self.sizes, default=0) > MAX_TREE_NODES:  # refused now, not by the chain's Tree after timing the rest
            raise InputError(f"--sizes must be at most {MAX_TREE_NODES} (the largest tree a target call verifies), "
                             f"got {max(self.sizes)}")
        if len(set(self.sizes)) < MIN_FIT_SIZES:
            given = ",".join(map(str, sorted(set(self.sizes)))) or "none"
            raise InputError(f"--sizes needs at least {MIN_FIT_SIZES} different sizes to fit the cost models "
                             f"(t = aN^2 + bN + c has {MIN_FIT_SIZES} coefficients), e.g. 1,2,4,8; got {given}")
        if not self.methods:
            raise InputError(f"--methods needs at least one of {', '.join(METHODS)}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise InputError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        for name in ("batch", "repeats", "prompt_len", "reference_n"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise InputError(f"warmup must be >= 0, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be >= 1, got {self.threads}")
        if self.fanout < 1:
            raise InputError(f"fanout must be >= 1, got {self.fanout}")
        for cfg in self.configs:
            if not cfg or any(n < 1 for n in cfg):
                raise InputError(f"tree configuration {cfg} must be a non-empty list of positive integers")

    def warnings(self, with_drafter: bool) -> list[str]:
        """Sentences about settings that measure less than a profile usually holds (none: nothing missing).

        Size 1, the autoregressive step, is only a reference: the fits leave it out once there are
        enough verify sizes, and tune-tree reads the AR step from the drafter timings, which time it
        on their own when --sizes lacks it. Without it the break-even table has no ratio against
        plain decoding, and a profile without a drafter holds no AR step at all.
        """
        if 1 in self.sizes:
            return []
        ar_step = ("the drafter timings still time the AR step, for tune-tree" if with_drafter
                   else "the profile holds no AR step")
        return [f"--sizes has no 1 (the autoregressive step): the break-even table gets no ratio against plain "
                f"decoding and {ar_step}; add 1 to --sizes to time it"]


def positive_ints(text: str, flag: str, example: str) -> tuple[int, ...]:
    """`3,2,1` -> (3, 2, 1); an empty item, a non-integer or a number below 1 is an InputError naming `flag`."""
    numbers = []
    for item in (t.strip() for t in text.split(",")):
        try:
            n = int(item)
        except ValueError:
            n = 0
        if n < 1:
            what = "an empty item" if not item else f"{item!r}"
            raise InputError(f"{flag} takes comma-separated positive integers such as {example}; {text!r} has {what}")
        numbers.append(n)
    return tuple(numbers)


def parse_sizes(text: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8), sorted and deduplicated; clear errors on anything else."""
    return tuple(sorted(set(positive_ints(text, "--sizes", "1,2,4,8"))))


def parse_methods(text: str) -> tuple[str, ...]:
    """`stree,chain` -> ("stree", "chain"), deduplicated in order; clear errors on unknown methods."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown:
        raise InputError(f"--methods must list some of {', '.join(METHODS)}, got {text!r}")
    return tuple(dict.fromkeys(methods))


def parse_configs(text: str) -> tuple[tuple[int, ...], ...]:
    """`3,2,1;4,2,1,1` -> ((3, 2, 1), (4, 2, 1, 1))."""
    parts = [part.strip() for part in text.split(";")]
    if not any(parts):
        raise InputError(f"--configs must look like 3,2,1;4,2,1,1, got {text!r}")
    if not all(parts):  # as --candidates and bandit arms: a stray ';' is a mistake, not a separator to skip
        raise InputError(f"--configs {text!r} has an empty configuration (a stray ';'); write e.g. 3,2,1;4,2,1,1")
    return tuple(positive_ints(part, "--configs", "3,2,1;4,2,1,1") for part in parts)
