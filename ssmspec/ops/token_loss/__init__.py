"""Training's token losses (next-token cross-entropy, forward KL to a target) with their gradient in
one pass over the logits."""
from .naive import naive_token_losses

__all__ = ["naive_token_losses"]
