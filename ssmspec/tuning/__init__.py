"""Choosing draft trees from measurements: acceptance statistics, expected lengths, static ranking, the UCB bandit."""
from .bandit import UCBTreePolicy, reward
from .expected import best_tree, best_trees, expected_config_length, expected_tree_length

__all__ = ["UCBTreePolicy", "best_tree", "best_trees", "expected_config_length", "expected_tree_length", "reward"]
