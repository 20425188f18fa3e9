"""The benchmark's configuration: one dataclass holding every default, and the methods it names."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ssmspec.trees import Tree, parse_tree_spec

from ..decoding.generate import DEFAULT_CHAIN, DEFAULT_STREE, METHODS
from ..errors import InputError


@dataclass
class BenchConfig:
    """Everything that shapes one `ssmspec bench` run; each default lives here only."""

    target: str = ""
    """Target model directory."""
    drafter: str | None = None
    """Drafter model directory, or 'ngram'; needed for chain and stree."""
    dataset: str = "humaneval"
    """humaneval, mt-bench, sharegpt, or a prompts file (.jsonl or .txt)."""
    methods: tuple[str, ...] = ("ar", "chain", "stree")
    """Methods to time; at temperature 0 `ar` always runs first (the losslessness reference)."""
    trees: tuple[str, ...] = ()
    """Tree specs for stree, each its own row (empty: the generator's default tree)."""
    draft_lens: tuple[int, ...] = ()
    """Draft lengths for chain, each its own row (empty: the generator's default length)."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    limit: int | None = None
    """Run the first K usable prompts (None: all)."""
    seed: int = 0
    """Sampling seed of every generation (temperature > 0)."""
    warmup: int = 2
    """Prompts run once, untimed, per method before its timed pass (compiles, graph captures)."""
    dtype: str | None = None
    """fp32, bf16, fp16 (None: the checkpoint's)."""
    device: str = "auto"
    backend: str = "auto"
    tie_tolerance: float | None = None
    """Largest fp32 logit gap between the two tokens at a bf16/fp16 divergence that counts as a
    numerical tie; None: TIE_ULPS units in the last place of the model dtype at the logits' magnitude."""
    time_split: bool = False
    """Add an untimed pass per method that splits the time into prefill / draft / verify / host,
    where the decode loop can measure it (it synchronizes the device, so it is kept apart)."""
    max_context: int | None = None
    """Skip prompts whose length + max_new_tokens exceeds this (None: the model's own limit, where it has one)."""

    def __post_init__(self):
        self.methods = tuple(self.methods)
        self.trees = tuple(self.trees)
        self.draft_lens = tuple(self.draft_lens)
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be a positive integer, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InputError(f"--temperature must be >= 0, got {self.temperature}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"--limit must be a positive integer, got {self.limit}")
        if self.warmup < 0:
            raise InputError(f"--warmup must be >= 0, got {self.warmup}")
        if self.tie_tolerance is not None and self.tie_tolerance < 0:
            raise InputError(f"--tie-tolerance must be >= 0, got {self.tie_tolerance}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MethodSpec:
    """One row of the table: a decoding method with its draft shape."""

    method: str
    tree: Tree | None = field(default=None, compare=False)
    label: str = ""

    @classmethod
    def make(cls, method: str, tree: Tree | None = None) -> "MethodSpec":
        label = method if tree is None else f"{method} {tree.num_drafted if method == 'chain' else tree.spec()}"
        return cls(method, tree, label)


def resolve_methods(config: BenchConfig) -> tuple[list[MethodSpec], str | None]:
    """The rows to run, in order, and a note when `ar` was added as the reference.

    Raises InputError for an unknown method, a speculative method without a drafter, or a
    --draft-len below 1 (and TreeSpecError for a malformed tree).
    """
    names = [m.strip() for m in config.methods if m.strip()]
    if not names:
        raise InputError(f"--methods is empty; choose from {', '.join(METHODS)}")
    for name in names:
        if name not in METHODS:
            raise InputError(f"unknown method {name!r} in --methods; choose from {', '.join(METHODS)}")
    if config.trees and "stree" not in names:
        raise InputError("--tree shapes the stree method, which --methods leaves out; add stree")
    if config.draft_lens and "chain" not in names:
        raise InputError("--draft-len shapes the chain method, which --methods leaves out; add chain")
    if config.drafter is None and any(n != "ar" for n in names):
        raise InputError("chain and stree need --drafter DIR (a model sharing the target's tokenizer) or --drafter ngram")
    note = None
    if config.temperature == 0 and "ar" not in names:
        names.insert(0, "ar")
        note = "ar added: at temperature 0 it is the reference every speculative method's output is checked against"
    elif "ar" in names:
        names.remove("ar")
        names.insert(0, "ar")
    specs: list[MethodSpec] = []
    for name in dict.fromkeys(names):
        if name == "ar":
            specs.append(MethodSpec.make("ar"))
        elif name == "chain":
            for n in config.draft_lens or (DEFAULT_CHAIN,):
                if n < 1:
                    raise InputError(f"--draft-len must be a positive integer, got {n}")
                specs.append(MethodSpec.make("chain", Tree.chain(n)))
        else:
            trees = [parse_tree_spec(t) for t in config.trees] or [Tree.from_config(DEFAULT_STREE)]
            specs.extend(MethodSpec.make("stree", t) for t in trees)
    unique = {spec.label: spec for spec in reversed(specs)}  # a shape given twice runs once
    return [spec for spec in specs if unique.get(spec.label) is spec], note
