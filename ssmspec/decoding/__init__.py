"""Decoding: drafters, verification rules, the generate loop and the Engine that runs it repeatedly."""
from .drafters import Draft, ModelDrafter, NgramDrafter
from .engine import Engine
from .generate import GenerationConfig, GenerationResult, generate
from .sampling import SamplingParams

__all__ = ["Draft", "Engine", "GenerationConfig", "GenerationResult", "ModelDrafter", "NgramDrafter", "SamplingParams",
           "generate"]
