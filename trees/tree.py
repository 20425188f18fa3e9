"""A token tree in packed topological order, built from a configuration or explicit parents."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

TREE_FILE_VERSION = 1
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
            return cls.from_parents(_int_list(d["parents"], "parents"))
        raise TreeSpecError("a tree file needs a 'config' list (e.g. [3, 2, 1]) or a 'parents' list")


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TreeSpecError(f"'{name}' must be a list of integers")
    return value


def parse_tree_spec(text: str) -> Tree:
    """`3,2,2,1` (a configuration), `parents:-1,0,0,1` (explicit), or the path of a tree.json."""
    text = text.strip()
    if not text:
        raise TreeSpecError("empty tree spec; write a configuration such as 3,2,1 or a tree.json path")
    if text.endswith(".json") or Path(text).is_file():
        return load_tree_file(text)
    if text.startswith("parents:"):
        body = text[len("parents:"):]
        try:
            return Tree.from_parents([int(t) for t in body.split(",")])
        except ValueError as e:
            raise TreeSpecError(f"malformed parents list {body!r}: {e}") from None
    try:
        levels = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise TreeSpecError(
            f"malformed tree spec {text!r}: expected comma-separated positive integers such as 3,2,1, "
            "'parents:-1,0,0,1', or a tree.json path"
        ) from None
    return Tree.from_config(levels)


def load_tree_file(path: str | Path) -> Tree:
    path = Path(path)
    if not path.is_file():
        raise TreeSpecError(f"tree file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TreeSpecError(f"tree file {path} is not valid JSON: {e}") from None
    return Tree.from_json(data.get("tree", data) if isinstance(data, dict) else data)


def save_tree_file(tree: Tree, path: str | Path, **extra) -> None:
    Path(path).write_text(json.dumps({**tree.to_json(), **extra}, indent=2) + "\n")
