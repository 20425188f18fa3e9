"""Activation replay: advance conv and SSM states along the accepted path only."""
from .naive import naive_replay_conv_state, naive_replay_ssm_state

__all__ = ["naive_replay_conv_state", "naive_replay_ssm_state"]
