"""Edits: pure kernel -> kernel functions, recorded as data.

    set tile.block = 128x256x64        SetField("tile", "block", (128, 256, 64))
    replace mma with mma op=wgmma ...  ReplaceNode(Mma(...))
    insert splitk mode=split_k ...     InsertNode(SplitK(...))
    remove splitk                      RemoveNode("splitk")

An edit list prints and parses back exactly, so a search step is a replayable record. `apply_edit` returns a
verified kernel or raises: an EditError when the edit does not fit the kernel's structure, or the verifier's typed
error when the result is an illegal schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Union

from .errors import EditError, ParseError
from .nodes import NODE_TYPES, OPTIONAL_NODES, Kernel, Node
from .text import parse_edits_raw, print_node, print_value
from .verify import verify

# Absent optional nodes that behave as their defaults, so `set` on them starts from the default instance.
_DEFAULTED = {"swizzle": NODE_TYPES["swizzle"]}


@dataclass(frozen=True)
class SetField:
    node: str
    field: str
    value: Any

    def __str__(self):
        return f"set {self.node}.{self.field} = {print_value(NODE_TYPES[self.node], self.field, self.value)}"


@dataclass(frozen=True)
class ReplaceNode:
    node: Node

    def __str__(self):
        return f"replace {self.node.kind} with {print_node(self.node)}"


@dataclass(frozen=True)
class InsertNode:
    node: Node

    def __str__(self):
        return f"insert {print_node(self.node)}"


@dataclass(frozen=True)
class RemoveNode:
    node: str

    def __str__(self):
        return f"remove {self.node}"


Edit = Union[SetField, ReplaceNode, InsertNode, RemoveNode]


def _node_class(name: str):
    cls = NODE_TYPES.get(name)
    if cls is None:
        raise EditError(f"unknown node '{name}' (nodes: {', '.join(NODE_TYPES)})")
    return cls


def apply_edit(kernel: Kernel, edit: Edit, check: bool = True) -> Kernel:
    """Apply one edit; the result is verified unless check=False (used when replaying a trusted record)."""
    if isinstance(edit, SetField):
        cls = _node_class(edit.node)
        types = cls.field_types()
        if edit.field not in types:
            raise EditError(f"{edit.node} has no field '{edit.field}' (fields: {', '.join(types)})")
        current = getattr(kernel, edit.node)
        if current is None:
            if edit.node not in _DEFAULTED:
                hint = f"; use 'insert {edit.node} ...'" if edit.node in OPTIONAL_NODES else ""
                raise EditError(f"kernel has no {edit.node} node to set {edit.field} on{hint}")
            current = _DEFAULTED[edit.node]()
        try:
            new_node = dataclasses.replace(current, **{edit.field: edit.value})
        except ParseError as e:
            raise EditError(f"set {edit.node}.{edit.field}: {e.message}") from None
        result = kernel.replace(**{edit.node: new_node})
    elif isinstance(edit, ReplaceNode):
        name = edit.node.kind
        if getattr(kernel, name) is None and name not in _DEFAULTED:
            raise EditError(f"kernel has no {name} node to replace; use 'insert {name} ...'")
        result = kernel.replace(**{name: edit.node})
    elif isinstance(edit, InsertNode):
        name = edit.node.kind
        if getattr(kernel, name) is not None:
            raise EditError(f"kernel already has a {name} node; use 'replace {name} with ...' or 'set'")
        result = kernel.replace(**{name: edit.node})
    elif isinstance(edit, RemoveNode):
        _node_class(edit.node)
        if edit.node == "target":
            raise EditError("the target node cannot be removed")
        if getattr(kernel, edit.node) is None:
            raise EditError(f"kernel has no {edit.node} node to remove")
        result = kernel.replace(**{edit.node: None})
    else:
        raise EditError(f"not an edit: {edit!r}")
    return verify(result) if check else result


def apply_edits(kernel: Kernel, edits: Iterable[Edit], check: bool = True) -> Kernel:
    for e in edits:
        kernel = apply_edit(kernel, e, check)
    return kernel


def parse_edits(text: str, filename: str | None = None) -> list[Edit]:
    """Parse edit lines; type errors in values are reported at their line and column."""
    raws, loc = parse_edits_raw(text, filename)
    out: list[Edit] = []
    for raw in raws:
        tag = raw[0]
        if tag == "set":
            _, node, fld, value, line, col = raw
            cls = NODE_TYPES.get(node)
            if cls is None:
                raise loc.error(f"unknown node '{node}' (nodes: {', '.join(NODE_TYPES)})", line, col)
            out.append(SetField(node, fld, loc.convert_field(cls, fld, value, (line, col + len(node) + 1))))
        elif tag == "replace":
            _, name, raw_node, line, col = raw
            node = loc.build_node(raw_node, NODE_TYPES)
            if node.kind != name:
                raise loc.error(f"'replace {name} with {node.kind} ...': the new node must be a {name}", line, col)
            out.append(ReplaceNode(node))
        elif tag == "insert":
            out.append(InsertNode(loc.build_node(raw[1], NODE_TYPES)))
        else:
            _, name, line, col = raw
            if name not in NODE_TYPES:
                raise loc.error(f"unknown node '{name}' (nodes: {', '.join(NODE_TYPES)})", line, col)
            out.append(RemoveNode(name))
    return out


def print_edits(edits: Iterable[Edit]) -> str:
    return "".join(f"{e}\n" for e in edits)
