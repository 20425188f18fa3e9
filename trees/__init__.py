"""Token trees: shapes, masks, paths and the text/JSON specs the CLI reads (imports no model)."""
from .tree import (TREE_FILE_SCHEMA, Tree, TreeArms, TreeSpecError, load_tree_file, parse_bandit_spec, parse_tree_spec,
                   save_tree_file)

__all__ = ["TREE_FILE_SCHEMA", "Tree", "TreeArms", "TreeSpecError", "load_tree_file", "parse_bandit_spec",
           "parse_tree_spec", "save_tree_file"]
