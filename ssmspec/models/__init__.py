"""Models: the Mamba-2 mixer, attention, MLP, the stacked language model, caches and loading."""
from .cache import AttentionLayerCache, MambaLayerCache, ModelCache
from .config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from .lm import LanguageModel

__all__ = [
    "AttentionConfig", "AttentionLayerCache", "LanguageModel", "MLPConfig", "MambaConfig",
    "MambaLayerCache", "ModelCache", "ModelConfig",
]
