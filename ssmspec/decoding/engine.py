"""Engine: a target and its drafter, prepared once for the kernels, generating repeatedly."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..models.fold import fold_for_kernels
from .generate import GenerationConfig, GenerationResult, decode_loop, drafted_trees
from .graphs import ChainPrefill


class Engine:
    """Generation from one target (and drafter), keeping what each call would otherwise rebuild.

    Made once from the models, it takes charge of them:

    - It prepares them for the kernels, here and before each generation: where the current
      backend runs the fused-norm kernels on a model's device (a GPU), it folds the model's
      RMSNorm weights into the projections after them, in place, on the very model objects it
      was given (models/fold.py; idempotent). The models compute the same function up to
      rounding the folded products to the weights' dtype: a bf16 model's logits move slightly,
      for every later user of those objects. On the reference path (the CPU) nothing is folded.
    - It owns the target's fast path: the decode cache (one per capacity bucket of
      _FastPath.BUCKET tokens, reset in place) and the CUDA graphs captured on it (steps, tree
      iterations, prefill chains), kept from one generation to the next; they go with the engine.
      One set is live at a time: a call that needs another (a longer capacity bucket, or `ar`
      after a speculative method, whose cache keeps pending slots, and back) rebuilds it and
      captures its graphs again. To alternate methods, use one engine per method (they may share
      the target: `Engine(target)` for ar, `Engine(target, drafter)` for the others).
      The drafter's buffers and graphs live in the ModelDrafter given here, which the engine
      drives and which is not to be shared with another engine.

    `ssmspec.decoding.generate` is the same loop for a single call: it prepares nothing, keeps
    nothing and leaves its models as it found them.

    Args:
        target: the model whose outputs are reproduced exactly (a LanguageModel; other targets,
            models/hf_causal.py, run eagerly and are not modified).
        drafter: a ModelDrafter or NgramDrafter, needed for the chain and stree methods.
    """

    def __init__(self, target, drafter=None):
        self.target, self.drafter = target, drafter
        self._fast_paths: dict = {}  # _FastPath.for_target's store: one live cache and its graphs
        self.prepare()

    def prepare(self) -> None:
        """Fold the target's and the drafter model's norm weights into their projections, in
        place, where the kernels fuse them (see the class docstring). Called at construction and
        before each generation, so that a backend chosen later or weights loaded since are
        prepared too; a model already folded costs a check per layer."""
        fold_for_kernels(self.target, getattr(self.drafter, "model", None))

    @property
    def fast_path(self):
        """The target's live fast path (_FastPath: cache and graphs), or None before the first
        generation that runs graphs."""
        return next(iter(self._fast_paths.values()), None)

    def generate(
        self,
        input_ids,
        config: GenerationConfig | None = None,
        *,
        decode: Callable[[list[int]], str] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate from `input_ids` (a list of ids or a (1, T) tensor) with `config`; as
        `ssmspec.decoding.generate`, on the prepared models and the kept fast path.

        Args:
            decode: ids -> text, needed only for stop strings.
            on_tokens: called with each batch of newly produced ids (streaming).
        """
        self.prepare()
        return decode_loop(self.target, input_ids, drafter=self.drafter, config=config, decode=decode,
                           on_tokens=on_tokens, fast_paths=self._fast_paths)

    def warm_up(self, config: GenerationConfig | None = None, token: int = 0) -> None:
        """Compile the kernels and capture the graphs that generations with `config` will use, so
        that timed or latency-sensitive calls pay none of it: one generation per tree the config
        may draft (every arm of a bandit) from a prompt of 2 * ChainPrefill.CHUNK - 1 tokens of
        `token`, which takes every prefill chain size once."""
        cfg = config or GenerationConfig()
        for tree in drafted_trees(cfg) if cfg.method != "ar" else (None,):
            one = dataclasses.replace(cfg, tree=tree, tree_policy=None, max_new_tokens=8, stop_strings=(),
                                      eos_token_id=None, timing=False)
            self.generate([token] * (2 * ChainPrefill.CHUNK - 1), one)
