"""A token tree in packed topological order, built from a configuration or explicit parents."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

TREE_FILE_VERSION = 1
TREE_FILE = "tree.json"
"""The file name `ssmspec tune-tree` writes in its --out directory (a --tree may name the directory)."""
MAX_TREE_NODES = 4096


class TreeSpecError(ValueError):
    """A tree specification that cannot be used; the message says what to write instead."""


@dataclass(frozen=True)
class Tree:
    """Node 0 is the root (the last produced token, not yet seen by the target).

    parents[i] < i for every non-root node (parents first), parents[0] = -1. `config` is the
    configuration (N1, ..., Ng) the tree was built from, or None for an explicit tree.
    """

    parents: tuple[int, ...]
    config: tuple[int, ...] | None = None
    _tensors: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise TreeSpecError("a tree needs node 0 as its root, with parent -1")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise TreeSpecError(f"node {i} has parent {p}: each parent must be an earlier node (topological order)")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Sequence[int]) -> "Tree":
        """Each node at depth i gets config[i] children (i from 0), laid out breadth-first."""
        config = tuple(int(n) for n in config)
        if not config:
            raise TreeSpecError("a tree configuration needs at least one level, e.g. 3,2,1")
        if any(n < 1 for n in config):
            raise TreeSpecError(f"every level of a tree configuration must be >= 1, got {','.join(map(str, config))}")
        if math.prod(config) > MAX_TREE_NODES or sum(math.prod(config[:i + 1]) for i in range(len(config))) > MAX_TREE_NODES:
            raise TreeSpecError(f"tree {','.join(map(str, config))} has more than {MAX_TREE_NODES} nodes")
        parents = [-1]
        level = [0]
        for width in config:
            next_level = []
            for node in level:
                for _ in range(width):
                    parents.append(node)
                    next_level.append(len(parents) - 1)
            level = next_level
        return cls(tuple(parents), config)

    @classmethod
    def chain(cls, length: int) -> "Tree":
        """A root followed by `length` drafted tokens in a line (length 0: the root alone)."""
        return cls.from_config([1] * length) if length else cls((-1,), ())

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> "Tree":
        return cls(tuple(int(p) for p in parents))

    # -- structure ---------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def num_drafted(self) -> int:
        return len(self.parents) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], start=1):
            d[i] = d[p] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        return self.child_lists()[node]

    def child_lists(self) -> list[list[int]]:
        """children of every node, in packed order (built once per tree)."""
        if "children" not in self._tensors:
            out: list[list[int]] = [[] for _ in self.parents]
            for i, p in enumerate(self.parents[1:], start=1):
                out[p].append(i)
            self._tensors["children"] = out
        return self._tensors["children"]

    def path(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(self.num_nodes) if i not in has_child]

    def level_widths(self) -> list[int]:
        """Number of nodes at each depth, root level first: the drafter's batch per step."""
        widths = [0] * (self.max_depth + 1)
        for d in self.depths:
            widths[d] += 1
        return widths

    def mask(self) -> torch.Tensor:
        """(N, N) bool: mask[i, j] when j is on the root-to-i path (i included)."""
        n = self.num_nodes
        m = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    # -- device tensors, built once per device -------------------------------------------------
    def _cached(self, key, device, build):
        device = torch.device(device)
        k = (key, str(device))
        if k not in self._tensors:
            # kept across calls: never an inference tensor (one made under torch.inference_mode
            # would be refused by autograd later, e.g. as a mask in training)
            with torch.inference_mode(False):
                self._tensors[k] = build().to(device)
        return self._tensors[k]

    def parents_tensor(self, device="cpu") -> torch.Tensor:
        return self._cached("parents", device, lambda: torch.tensor(self.parents, dtype=torch.long))

    def depth_tensor(self, device="cpu") -> torch.Tensor:
        return self._cached("depth", device, lambda: torch.tensor(self.depths, dtype=torch.long))

    def mask_tensor(self, device="cpu") -> torch.Tensor:
        return self._cached("mask", device, self.mask)

    # -- text and file forms ---------------------------------------------------------------------
    def spec(self) -> str:
        if self.config is not None:
            return ",".join(map(str, self.config))
        return "parents:" + ",".join(map(str, self.parents))

    def to_json(self) -> dict:
        d = {"version": TREE_FILE_VERSION, "parents": list(self.parents)}
        if self.config is not None:
            d["config"] = list(self.config)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Tree":
        if not isinstance(d, dict):
            raise TreeSpecError("a tree file must hold a JSON object with 'config' or 'parents'")
        version = d.get("version", TREE_FILE_VERSION)
        if version != TREE_FILE_VERSION:
            raise TreeSpecError(f"tree file version {version} is not supported (expected {TREE_FILE_VERSION})")
        if "config" in d:
            tree = cls.from_config(_int_list(d["config"], "config"))
            if "parents" in d and tuple(d["parents"]) != tree.parents:
                raise TreeSpecError("the tree file's 'parents' do not match its 'config'")
            return tree
        if "parents" in d:
            return _drafting(cls.from_parents(_int_list(d["parents"], "parents")))
        raise TreeSpecError("a tree file needs a 'config' list (e.g. [3, 2, 1]) or a 'parents' list")


def _drafting(tree: Tree) -> Tree:
    """A tree a user gives drafts at least one node below its root (a root alone would run the
    drafter for nothing; configurations say so by refusing a level of 0)."""
    if tree.num_nodes < 2:
        raise TreeSpecError("a draft tree needs at least one node below the root, e.g. parents:-1,0")
    return tree


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TreeSpecError(f"'{name}' must be a list of integers")
    return value


def parse_tree_spec(text: str) -> "Tree | TreeArms":
    """`3,2,2,1` (a configuration), `parents:-1,0,0,1` (explicit), `bandit:4,2,1;3,2,2,1,1` (arms
    for the UCB bandit, options as `bandit[lambda_ucb=0.5,lambda_gamma=0.1,state=keep]:...`), or
    the path of a tree.json (a tree, or an arm set written by `ssmspec tune-tree`), or of the
    directory holding one (tune-tree's --out, as --profile takes profile's)."""
    text = text.strip()
    if not text:
        raise TreeSpecError("empty tree spec; write a configuration such as 3,2,1 or a tree.json path")
    if text.startswith("bandit"):
        return parse_bandit_spec(text)
    if Path(text).is_dir():
        if not (Path(text) / TREE_FILE).is_file():
            raise TreeSpecError(f"tree spec {text} is a directory without a {TREE_FILE} (`ssmspec tune-tree --out` writes one)")
        return load_tree_file(Path(text) / TREE_FILE)
    if text.endswith(".json") or Path(text).is_file():
        return load_tree_file(text)
    return _parse_one_tree(text)


def _parse_one_tree(text: str) -> Tree:
    if text.startswith("parents:"):
        body = text[len("parents:"):]
        try:
            tree = Tree.from_parents([int(t) for t in body.split(",")])
        except ValueError as e:
            raise TreeSpecError(f"malformed parents list {body!r}: {e}") from None
        return _drafting(tree)
    try:
        levels = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise TreeSpecError(
            f"malformed tree spec {text!r}: expected comma-separated positive integers such as 3,2,1, "
            "'parents:-1,0,0,1', or a tree.json path"
        ) from None
    return Tree.from_config(levels)


# -- the bandit's arm set ------------------------------------------------------------------------
BANDIT_STATES = ("request", "keep")


@dataclass(frozen=True)
class TreeArms:
    """Tree shapes for the UCB bandit to choose among, one per decoding step (mamba-drafters
    paper, section 4.2). The policy itself lives in ssmspec.tuning.bandit; this is its spec."""

    arms: tuple[Tree, ...]
    lambda_ucb: float = 1.0
    """Weight of the exploration bonus lambda_ucb * sqrt(2 ln t / n_k)."""
    lambda_gamma: float = 0.0
    """Drafting cost per draft level relative to a target call (T_draft / T_target) in the reward
    -(1 + lambda_gamma * depth) / tokens; `ssmspec tune-tree` writes the profile's value."""
    state: str = "request"
    """request: the bandit starts afresh with each generation; keep: it learns across them."""

    def __post_init__(self):
        if not self.arms:
            raise TreeSpecError("a bandit needs at least one arm, e.g. bandit:4,2,1;3,2,2,1,1")
        if len({a.parents for a in self.arms}) != len(self.arms):
            raise TreeSpecError(f"the bandit's arms repeat a tree: {self.spec()}")
        for name in ("lambda_ucb", "lambda_gamma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise TreeSpecError(f"bandit option {name} must be a number >= 0, got {v!r}")
        if self.state not in BANDIT_STATES:
            raise TreeSpecError(f"bandit option state must be one of {', '.join(BANDIT_STATES)}, got {self.state!r}")

    @property
    def largest(self) -> Tree:
        """The arm with the most nodes (then the deepest): buffers are sized for it."""
        return max(self.arms, key=lambda t: (t.num_nodes, t.max_depth))

    @property
    def is_chain(self) -> bool:
        return all(a.is_chain for a in self.arms)

    def spec(self) -> str:
        opts = f"[lambda_ucb={self.lambda_ucb:g},lambda_gamma={self.lambda_gamma:g},state={self.state}]"
        return f"bandit{opts}:" + ";".join(a.spec() for a in self.arms)

    def to_json(self) -> dict:
        return {"arms": [a.to_json() for a in self.arms], "lambda_ucb": self.lambda_ucb,
                "lambda_gamma": self.lambda_gamma, "state": self.state}

    @classmethod
    def from_json(cls, d: dict) -> "TreeArms":
        if not isinstance(d, dict) or not isinstance(d.get("arms"), list):
            raise TreeSpecError("a tree file's 'bandit' must be an object with an 'arms' list")
        extra = set(d) - {"arms", "lambda_ucb", "lambda_gamma", "state"}
        if extra:
            raise TreeSpecError(f"unknown bandit field(s) {', '.join(sorted(extra))} in the tree file")
        opts = {k: d[k] for k in ("lambda_ucb", "lambda_gamma", "state") if k in d}
        return cls(tuple(Tree.from_json(a) for a in d["arms"]), **opts)


def parse_bandit_spec(text: str) -> TreeArms:
    """`bandit:4,2,1;3,2,2,1,1` or `bandit[lambda_ucb=0.5,lambda_gamma=0.1,state=keep]:4,2,1;...`."""
    head, sep, body = text.partition(":")
    if not sep or not body.strip():
        raise TreeSpecError(f"malformed bandit spec {text!r}: write bandit:4,2,1;3,2,2,1,1 (arms separated by ';')")
    opts: dict = {}
    head = head.strip()
    if head != "bandit":
        if not (head.startswith("bandit[") and head.endswith("]")):
            raise TreeSpecError(f"malformed bandit spec {text!r}: options go in brackets, e.g. bandit[lambda_ucb=0.5]:4,2,1;3,2,1")
        for item in filter(None, (t.strip() for t in head[len("bandit["):-1].split(","))):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in ("lambda_ucb", "lambda_gamma", "state"):
                raise TreeSpecError(f"unknown bandit option {item!r}; use lambda_ucb=X, lambda_gamma=X, state=request|keep")
            if key == "state":
                opts[key] = value
                continue
            try:
                opts[key] = float(value)
            except ValueError:
                raise TreeSpecError(f"bandit option {key} must be a number, got {value!r}") from None
    arms = [part.strip() for part in body.split(";")]
    if any(not a for a in arms):
        raise TreeSpecError(f"malformed bandit spec {text!r}: an arm is empty (stray ';')")
    return TreeArms(tuple(_parse_one_tree(a) for a in arms), **opts)


TREE_FILE_SCHEMA = "ssmspec.tree"
"""The `schema` of tree.json files written by `ssmspec tune-tree` (a bare tree needs none)."""


def read_json_file(path: str | Path, what: str, error: type[Exception] = TreeSpecError, missing_hint: str = ""):
    """The parsed JSON of a file the user named, or `error` with one sentence: the file is missing
    (then `missing_hint` is appended) or not valid JSON. `what` names the file ("tree file")."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist{missing_hint}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{what} {path} is not valid JSON: {e}") from None


def load_tree_file(path: str | Path) -> "Tree | TreeArms":
    """A tree.json: a bare tree ({config} or {parents}), or tune-tree's file holding a 'tree' or a 'bandit'."""
    path = Path(path)
    data = read_json_file(path, "tree file")
    if isinstance(data, dict) and "schema" in data:
        if data["schema"] != TREE_FILE_SCHEMA:
            raise TreeSpecError(f"tree file {path} has schema {data['schema']!r}, not {TREE_FILE_SCHEMA!r}")
        if data.get("version") != TREE_FILE_VERSION:
            raise TreeSpecError(f"tree file {path} version {data.get('version')} is not supported (expected {TREE_FILE_VERSION})")
        if ("tree" in data) == ("bandit" in data):
            raise TreeSpecError(f"tree file {path} must hold exactly one of 'tree' and 'bandit'")
    if isinstance(data, dict) and "bandit" in data:
        return TreeArms.from_json(data["bandit"])
    return Tree.from_json(data.get("tree", data) if isinstance(data, dict) else data)


def save_tree_file(tree: Tree, path: str | Path, **extra) -> None:
    Path(path).write_text(json.dumps({**tree.to_json(), **extra}, indent=2) + "\n")
