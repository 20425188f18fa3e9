"""Trees: construction from configurations and parents, masks, paths, specs and files."""
import json

import pytest
import torch

from ssmspec.trees import Tree, TreeSpecError, load_tree_file, parse_tree_spec, save_tree_file


def test_from_config_is_breadth_first_with_contiguous_siblings():
    tree = Tree.from_config((2, 3))
    assert tree.num_nodes == 1 + 2 + 6
    assert tree.parents == (-1, 0, 0, 1, 1, 1, 2, 2, 2)
    assert tree.depths == (0, 1, 1, 2, 2, 2, 2, 2, 2)
    assert tree.level_widths() == [1, 2, 6]
    assert tree.leaves() == [3, 4, 5, 6, 7, 8]
    assert tree.path(7) == [0, 2, 7]


def test_mask_marks_exactly_the_ancestors():
    tree = Tree.from_config((2, 2, 1))
    mask = tree.mask()
    for i in range(tree.num_nodes):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(tree.path(i))


def test_chain_is_a_configuration_of_ones():
    assert Tree.chain(4) == Tree.from_config((1, 1, 1, 1))
    assert Tree.chain(4).is_chain and not Tree.from_config((2, 1)).is_chain


@pytest.mark.parametrize("spec, nodes", [("3,2,2,1", 1 + 3 + 6 + 12 + 12), ("1", 2), (" 2, 2 ", 7), ("parents:-1,0,0,1", 4)])
def test_parse_tree_spec(spec, nodes):
    assert parse_tree_spec(spec).num_nodes == nodes


@pytest.mark.parametrize("spec", ["", "3,,2", "a,b", "3,0,1", "-1", "parents:-1,1", "parents:0,0", "parents:-1,x"])
def test_malformed_specs_raise_a_clear_error(spec):
    with pytest.raises(TreeSpecError):
        parse_tree_spec(spec)


def test_tree_file_round_trip(tmp_path):
    path = tmp_path / "tree.json"
    tree = Tree.from_config((3, 1, 2))
    save_tree_file(tree, path, note="from a test")
    assert load_tree_file(path) == tree
    assert parse_tree_spec(str(path)) == tree
    explicit = Tree.from_parents([-1, 0, 0, 2, 2, 4])
    save_tree_file(explicit, path)
    assert load_tree_file(path) == explicit


def test_a_tree_spec_may_name_the_directory_tune_tree_wrote(tmp_path):
    tree = Tree.from_config((2, 1))
    save_tree_file(tree, tmp_path / "tree.json")
    assert parse_tree_spec(str(tmp_path)) == tree
    (tmp_path / "empty").mkdir()
    with pytest.raises(TreeSpecError, match="directory without a tree.json"):
        parse_tree_spec(str(tmp_path / "empty"))


def test_a_root_alone_is_no_draft_tree(tmp_path):
    for spec in ("parents:-1", "bandit:2,1;parents:-1"):
        with pytest.raises(TreeSpecError, match="at least one node below the root"):
            parse_tree_spec(spec)
    path = tmp_path / "tree.json"
    path.write_text('{"parents": [-1]}')
    with pytest.raises(TreeSpecError, match="at least one node below the root"):
        parse_tree_spec(str(path))
    assert Tree.from_parents([-1]).num_nodes == 1  # still a tree inside (a prefill chain of one token)


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"config": "3,2"}', '{"version": 9, "config": [2]}', "{}"])
def test_bad_tree_files_raise(tmp_path, content):
    path = tmp_path / "tree.json"
    path.write_text(content)
    with pytest.raises(TreeSpecError):
        load_tree_file(path)


def test_missing_tree_file(tmp_path):
    with pytest.raises(TreeSpecError, match="does not exist"):
        parse_tree_spec(str(tmp_path / "nope.json"))


def test_oversized_tree_refused():
    with pytest.raises(TreeSpecError, match="more than"):
        Tree.from_config((64, 64, 64))


def test_json_form_keeps_config():
    d = json.loads(json.dumps(Tree.from_config((2, 1)).to_json()))
    assert d["config"] == [2, 1] and d["parents"] == [-1, 0, 0, 1, 2]
