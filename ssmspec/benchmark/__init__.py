"""`ssmspec bench`: speed and losslessness of ar, chain and stree on prompt sets, as a library."""
from .config import BenchConfig, MethodSpec, resolve_methods
from .lossless import Verdict, check_lossless, default_tie_tolerance
from .prompts import DATASETS, Prompt, load_prompts
from .runner import BenchResult, run_bench

__all__ = [
    "BenchConfig", "BenchResult", "DATASETS", "MethodSpec", "Prompt", "Verdict", "check_lossless",
    "default_tie_tolerance", "load_prompts", "resolve_methods", "run_bench",
]
