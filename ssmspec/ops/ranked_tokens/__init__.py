"""The drafter's children on the device: the r-th most likely token of a logits row (top-k
children), or a draw from it by an exponential race (sampled children), per node."""
from .naive import naive_race_tokens, naive_ranked_tokens

__all__ = ["naive_race_tokens", "naive_ranked_tokens"]
