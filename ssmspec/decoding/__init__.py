"""Decoding: drafters, verification rules and the generate loop."""
from .drafters import Draft, ModelDrafter, NgramDrafter
from .generate import GenerationConfig, GenerationResult, generate, warm_up
from .sampling import SamplingParams

__all__ = ["Draft", "GenerationConfig", "GenerationResult", "ModelDrafter", "NgramDrafter", "SamplingParams", "generate", "warm_up"]
