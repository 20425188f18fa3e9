"""Token trees: shapes, masks, paths and the text/JSON specs the CLI reads (imports no model)."""
from .tree import Tree, TreeSpecError, load_tree_file, parse_tree_spec, save_tree_file

__all__ = ["Tree", "TreeSpecError", "load_tree_file", "parse_tree_spec", "save_tree_file"]
