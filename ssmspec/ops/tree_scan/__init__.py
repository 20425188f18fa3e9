"""SSM scan over a packed token tree: every node sees only its own root-to-node path."""
from .naive import ancestor_mask, naive_tree_scan

__all__ = ["ancestor_mask", "naive_tree_scan"]
