"""A transformers causal LM (Llama, Qwen2, Mistral, Gemma, ...) as a speculative-decoding target.

`TransformersTarget` gives a transformers `*ForCausalLM` the paths the decode loop calls on a
target: `forward` (prefill), `step`, `verify` of a packed token tree in one call, and `replay` of
the accepted path. The keys and values live in ssmspec's own cache (`ModelCache` of
`AttentionLayerCache`, after RoPE), so a tree's entries are kept or dropped exactly as in
ssmspec's attention (models/attention.py); each call hands transformers the prefix as a
`DynamicCache` and an explicit 4D additive mask (prefix, then causal or tree mask over the new
tokens) with positions = prefix length + depth, and reads the new tokens' keys and values back.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import InputError
from .attention import AttentionTreeActivations, write_kv
from .cache import AttentionLayerCache, ModelCache
from .config import AttentionConfig, MLPConfig, ModelConfig
from .lm import TreeActivations


# sdpa's backends for transformers' attention here: all but cuDNN's, which plans anew for every new
# key length (each decode step's, while a length is new: a first pass over 30 steps at Qwen2.5-1.5B's
# shape took 96.8 ms per step against 45.1 without it on an H100, the same ~41 ms once planned).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _one_id(value):
    """A config's token id, the first where it lists several (ModelConfig keeps one)."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return value


def shape_config(text) -> ModelConfig:
    """A ModelConfig with the shape of a transformers decoder config (`text`): one attention and
    one MLP sublayer per layer, its heads, widths and special ids. A description for profiling,
    fingerprints and vocabulary checks; transformers runs the model itself (details such as
    Gemma's scaled embeddings are not in it)."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    rope = getattr(text, "rope_parameters", None) or {}
    return ModelConfig(
        vocab_size=text.vocab_size, d_model=text.hidden_size, layers=["attention", "mlp"] * text.num_hidden_layers,
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
            qkv_bias=bool(getattr(text, "attention_bias", False)) or text.model_type == "qwen2"),
        mlp=MLPConfig(d_intermediate=text.intermediate_size, activation=getattr(text, "hidden_act", "silu")),
        norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        bos_token_id=_one_id(getattr(text, "bos_token_id", None)),
        eos_token_id=_one_id(getattr(text, "eos_token_id", None)),
        pad_token_id=_one_id(getattr(text, "pad_token_id", None)),
    )


class TransformersTarget(nn.Module):
    """A transformers causal LM with forward / step / verify / replay over an explicit KV cache."""

    def __init__(self, hf_model: nn.Module, tokenizer=None):
        super().__init__()
        self.hf = hf_model
        self.tokenizer = tokenizer
        text = hf_model.config.get_text_config(decoder=True)
        self.config = shape_config(text)
        """The stack's shape as a ModelConfig (attention + MLP sublayers): what the decode loop,
        vocabulary checks, fingerprints and profile.json read. transformers' own is `hf.config`."""
        self.sliding_window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
        # transformers 5 renamed past_key_values to cache; accept either.
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None, pending: int = 0) -> ModelCache:
        """An empty cache for `batch` rows of up to max_len positions (`pending` is for SSM layers: ignored).

        Raises InputError where max_len passes the model's sliding window: the paths here attend
        to the whole prefix, which equals the model only inside its window."""
        if self.sliding_window is not None and max_len > self.sliding_window:
            raise InputError(f"{max_len} positions (prompt, new tokens and tree) pass this model's sliding window of "
                             f"{self.sliding_window}; ask for fewer new tokens or a shorter prompt")
        device = device or self.device
        dtype = dtype or self.dtype
        a = self.config.attention
        shape = (batch, a.n_kv_heads, max_len, a.head_dim)
        layers = [AttentionLayerCache(torch.zeros(shape, device=device, dtype=dtype),
                                      torch.zeros(shape, device=device, dtype=dtype))
                  for _ in range(self.config.layers.count("attention"))]
        return ModelCache(layers, torch.zeros(batch, dtype=torch.long, device=device))

    def settle(self, cache: ModelCache) -> None:
        """Nothing to flush: the cache keeps no pending SSM inputs."""

    def _run(self, tokens: torch.Tensor, cache: ModelCache, depth: torch.Tensor, new_mask: torch.Tensor,
             last_only: bool = False):
        """transformers on new tokens after each row's cached prefix.

        Args:
            tokens: (B, N); depth: (N,) offsets of their positions after the prefix;
            new_mask: (N, N) bool, which new tokens each new token sees (causal or tree mask).
        Returns:
            logits (B, N, V) fp32 (B, 1, V with last_only), and per layer the new tokens' keys
            and values (B, Hkv, N, D) after RoPE.
        """
        from transformers import DynamicCache

        batch, n = tokens.shape
        device = tokens.device
        prefix = int(cache.seqlen.max())  # the longest row's prefix; shorter rows mask the rest
        past = DynamicCache(ddp_cache_data=[(c.keys[:, :, :prefix], c.values[:, :, :prefix]) for c in cache.layers])
        seen = torch.arange(prefix, device=device)[None, :] < cache.seqlen[:, None]  # (B, prefix)
        allowed = torch.cat([seen[:, None, :].expand(batch, n, prefix), new_mask[None].expand(batch, n, n)], dim=-1)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)  # additive: eager and sdpa read it alike
        positions = cache.seqlen[:, None] + depth[None, :]  # (B, N): RoPE follows depth, not packed index
        with sdpa_kernel(_SDPA_BACKENDS):
            out = self.hf(input_ids=tokens, attention_mask=mask[:, None], position_ids=positions, use_cache=True,
                          logits_to_keep=1 if last_only else 0, **{self._cache_kwarg: past})
        new = [(layer.keys[:, :, prefix:], layer.values[:, :, prefix:]) for layer in past.layers]  # grown in place
        return out.logits.float(), new

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Causal tokens (B, T) after the cache's prefix -> logits (B, T, V) fp32 (B, 1, V with
        last_only); the cache, when given, advanced by T."""
        if cache is None:  # a whole sequence (scoring, distillation): transformers' own causal path
            return self.hf(input_ids=input_ids, use_cache=False, logits_to_keep=1 if last_only else 0).logits.float()
        steps = input_ids.shape[1]
        device = input_ids.device
        causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
        logits, new = self._run(input_ids, cache, torch.arange(steps, device=device), causal, last_only)
        for i, (layer, (k, v)) in enumerate(zip(cache.layers, new)):
            write_kv(layer, cache.seqlen, k, v, check=i == 0)  # every layer writes the same positions
        cache.seqlen += steps
        return logits

    def step(self, input_ids: torch.Tensor, cache: ModelCache, float_logits: bool = True) -> torch.Tensor:
        """One token per row: input_ids (B, 1) -> logits (B, 1, V); cache advanced by one
        (float_logits as in LanguageModel.step: fp32 either way here)."""
        return self.forward(input_ids, cache)

    def verify(self, tokens: torch.Tensor, tree, cache: ModelCache, float_logits: bool = True):
        """Logits of every node of a packed token tree in one call; the cache is left untouched.

        Args:
            tokens: (B, N) packed tree tokens, node 0 the root.
            tree: a `ssmspec.trees.Tree` (depths, ancestor mask).
            cache: the state after the prefix.
        Returns:
            logits (B, N, V) fp32, and TreeActivations (the nodes' keys and values per layer) for `replay`.
        """
        device = tokens.device
        logits, new = self._run(tokens, cache, tree.depth_tensor(device), tree.mask_tensor(device))
        return logits, TreeActivations([AttentionTreeActivations(k, v) for k, v in new])

    def replay(self, cache: ModelCache, acts: TreeActivations, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Keep exactly the accepted path's keys and values, in order, after the prefix: path (B, M)
        node indices (root first), path_len (B,) how many of them are accepted."""
        rows = torch.arange(path.shape[0], device=path.device)[:, None]
        for i, (layer, a) in enumerate(zip(cache.layers, acts.layers)):
            k = a.keys.transpose(1, 2)[rows, path].transpose(1, 2)  # (B, Hkv, M, D)
            v = a.values.transpose(1, 2)[rows, path].transpose(1, 2)
            write_kv(layer, cache.seqlen, k, v, count=path_len, check=i == 0)
        cache.seqlen += path_len.to(cache.seqlen.dtype)
