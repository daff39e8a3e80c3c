"""Parse and print the L2IR text format (grammar in l2ir.lark).

The printer is canonical: every field of every node, in declaration order, one node per line. Printing and parsing
round-trip exactly: `parse_kernel(print_kernel(k)) == k`, and printing a parse of canonical text gives the text back.
Every error carries a line and a column and says what was expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import lark
from lark import Transformer, v_args

from .errors import ExprError, ParseError
from .indexing import Bin, Call, Const, Expr, Var
from .nodes import KERNEL_ORDER, NODE_TYPES, Kernel, Node, Problem

# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _parser() -> lark.Lark:
    grammar = resources.files("l2ir").joinpath("l2ir.lark").read_text()
    return lark.Lark(grammar, parser="lalr", start=["kernel_file", "problem_file", "edit_list", "expr_only"],
                     propagate_positions=True, maybe_placeholders=False)


_TOKEN_NAMES = {
    "NAME": "a name", "INT": "an integer", "DIMS": "dims like 128x128x32", "NEWLINE": "a new line",
    "SEMICOLON": "';'", "EQUAL": "'='", "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'",
    "COMMA": "','", "LESSTHAN": "'<'", "MORETHAN": "'>'", "COLON": "':'", "DOT": "'.'", "STRING": "a string",
    "CODE": "a ``` code block", "KERNEL": "'kernel'", "SET": "'set'", "REPLACE": "'replace'", "WITH": "'with'",
    "INSERT": "'insert'", "REMOVE": "'remove'", "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/' or '%'",
    "SHIFT_OP": "'<<' or '>>'", "CIRCUMFLEX": "'^'", "AMPERSAND": "'&'", "$END": "end of input",
}


def _describe_expected(expected) -> str:
    names = sorted({_TOKEN_NAMES.get(t, t) for t in expected})
    if not names:
        return ""
    if len(names) > 6:
        names = names[:6] + ["..."]
    return "; expected " + ", ".join(names)


def _line_of(text: str, line: int | None) -> str | None:
    if line is None:
        return None
    lines = text.split("\n")   # as the lexer counts lines (splitlines would also split at \x0c, \u2028, ...)
    return lines[line - 1] if 0 < line <= len(lines) else None


def _raise_lark(e: lark.exceptions.LarkError, text: str, filename: str | None) -> None:
    if isinstance(e, lark.exceptions.UnexpectedToken):
        tok = e.token
        got = "end of input" if tok.type == "$END" else repr(str(tok))
        msg = f"unexpected {got}{_describe_expected(e.expected)}"
    elif isinstance(e, lark.exceptions.UnexpectedCharacters):
        msg = f"unexpected character {text[e.pos_in_stream]!r}{_describe_expected(e.allowed)}"
    elif isinstance(e, lark.exceptions.UnexpectedEOF):
        msg = f"unexpected end of input{_describe_expected(e.expected)}"
    elif isinstance(e, lark.exceptions.VisitError) and isinstance(e.orig_exc, ParseError):
        orig = e.orig_exc
        raise ParseError(orig.message, orig.line, orig.column, _line_of(text, orig.line), filename) from None
    elif isinstance(e, lark.exceptions.VisitError) and isinstance(e.orig_exc, ExprError):
        raise ParseError(str(e.orig_exc), filename=filename) from None
    else:
        raise ParseError(str(e), filename=filename) from None
    line = getattr(e, "line", None)
    column = getattr(e, "column", None)
    if line is not None and line < 0:
        lines = text.splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
    raise ParseError(msg, line, column, _line_of(text, line), filename) from None


@dataclass(frozen=True)
class Raw:
    """A parsed value before it meets its field type, with its position for error messages."""

    kind: str
    payload: Any
    line: int
    column: int


@dataclass(frozen=True)
class RawNode:
    name: str
    fields: tuple[tuple[str, Raw, int, int], ...]   # (field name, value, line, column)
    line: int
    column: int


def _pos(meta_or_tok) -> tuple[int, int]:
    return getattr(meta_or_tok, "line", 0), getattr(meta_or_tok, "column", 0)


class _ToRaw(Transformer):
    """Tree -> raw values, node lines, edits and expressions."""

    # values ------------------------------------------------------------------------------------------------
    @v_args(meta=True)
    def int(self, meta, items):
        return Raw("int", int(items[0]), *_pos(meta))

    @v_args(meta=True)
    def dims(self, meta, items):
        return Raw("tuple", tuple(int(x) for x in str(items[0]).split("x")), *_pos(meta))

    @v_args(meta=True)
    def swizzle(self, meta, items):
        return Raw("swizzle", tuple(int(x) for x in items), *_pos(meta))

    @v_args(meta=True)
    def pair(self, meta, items):
        return Raw("pair", (str(items[0]), str(items[1])), *_pos(meta))

    @v_args(meta=True)
    def name(self, meta, items):
        return Raw("name", str(items[0]), *_pos(meta))

    @v_args(meta=True)
    def string(self, meta, items):
        return Raw("string", str(items[0])[1:-1], *_pos(meta))

    @v_args(meta=True)
    def exprs(self, meta, items):
        return Raw("exprs", tuple(items), *_pos(meta))

    @v_args(meta=True)
    def code(self, meta, items):
        text = str(items[0])
        body = text[text.index("\n") + 1: -len("\n```")]
        return Raw("code", body, *_pos(meta))

    # expressions -------------------------------------------------------------------------------------------
    def const(self, items):
        return Const(int(items[0]))

    def var(self, items):
        return Var(str(items[0]))

    def call(self, items):
        try:
            return Call(str(items[0]), tuple(items[1:]))
        except ExprError as e:
            raise ParseError(str(e), items[0].line, items[0].column) from None

    def bin_op(self, items):
        return Bin(str(items[1]), items[0], items[2])

    def xor_op(self, items):
        return Bin("^", items[0], items[1])

    def and_op(self, items):
        return Bin("&", items[0], items[1])

    def expr_only(self, items):
        return items[0]

    # statements --------------------------------------------------------------------------------------------
    def field(self, items):
        name, value = items
        return (str(name), value, name.line, name.column)

    @v_args(meta=True)
    def node_line(self, meta, items):
        return RawNode(str(items[0]), tuple(items[1:]), *_pos(meta))

    def problem_stmt(self, items):
        return ("problem", items[0])

    def kernel(self, items):
        return ("kernel", [x for x in items if isinstance(x, RawNode)])

    def kernel_file(self, items):
        items = [x for x in items if isinstance(x, tuple)]
        problem = next((x[1] for x in items if x[0] == "problem"), None)
        kernel = next(x[1] for x in items if x[0] == "kernel")
        return problem, kernel

    def problem_file(self, items):
        return next(x for x in items if isinstance(x, RawNode))

    def set_edit(self, items):
        node, fld, value = items
        return ("set", str(node), str(fld), value, node.line, node.column)

    def replace_edit(self, items):
        return ("replace", str(items[0]), items[1], items[0].line, items[0].column)

    def insert_edit(self, items):
        return ("insert", items[0])

    def remove_edit(self, items):
        return ("remove", str(items[0]), items[0].line, items[0].column)

    def edit_list(self, items):
        return [x for x in items if isinstance(x, tuple)]

    def NEWLINE(self, tok):
        return None


def _parse_tree(text: str, start: str, filename: str | None):
    text = text.replace("\r\n", "\n")   # files written on Windows (CRLF) parse like any other
    try:
        tree = _parser().parse(text, start=start)
        return _ToRaw().transform(tree)
    except lark.exceptions.LarkError as e:
        _raise_lark(e, text, filename)


class _Located:
    """Builds typed nodes from raw ones, turning every failure into a ParseError at the right line and column."""

    def __init__(self, text: str, filename: str | None):
        self.text, self.filename = text, filename

    def error(self, msg: str, line: int, column: int) -> ParseError:
        return ParseError(msg, line, column, _line_of(self.text, line), self.filename)

    def convert_field(self, cls: type[Node], fname: str, raw: Raw, at: tuple[int, int] | None = None) -> Any:
        types = cls.field_types()
        if fname not in types:
            line, column = at or (raw.line, raw.column)
            raise self.error(f"{cls.kind} has no field '{fname}' (fields: {', '.join(types)})", line, column)
        try:
            return types[fname].convert(raw.kind, raw.payload)
        except ValueError as e:
            raise self.error(f"{cls.kind}.{fname}: {e}", raw.line, raw.column) from None

    def build_node(self, raw: RawNode, allowed: dict[str, type[Node]]) -> Node:
        cls = allowed.get(raw.name)
        if cls is None:
            raise self.error(f"unknown node '{raw.name}' (expected one of: {', '.join(allowed)})", raw.line, raw.column)
        values: dict[str, Any] = {}
        for fname, value, line, column in raw.fields:
            if fname in values:
                raise self.error(f"{cls.kind}.{fname} given twice", line, column)
            values[fname] = self.convert_field(cls, fname, value, (line, column))
        missing = [n for n in cls.required_fields() if n not in values]
        if missing:
            raise self.error(f"{cls.kind} is missing required field(s): {', '.join(missing)}", raw.line, raw.column)
        try:
            return cls(**values)
        except ParseError as e:
            raise self.error(e.message, raw.line, raw.column) from None

    def build_kernel(self, raws: list[RawNode]) -> tuple[Kernel, dict[str, int]]:
        nodes: dict[str, Node] = {}
        lines: dict[str, int] = {}
        for raw in raws:
            if raw.name in nodes:
                raise self.error(f"duplicate '{raw.name}' node (first at line {lines[raw.name]})", raw.line, raw.column)
            nodes[raw.name] = self.build_node(raw, NODE_TYPES)
            lines[raw.name] = raw.line
        if "target" not in nodes:
            line = raws[0].line if raws else 1
            raise self.error("kernel has no 'target' node", line, 1)
        return Kernel(**nodes), lines


def parse_kernel_file(text: str, filename: str | None = None) -> tuple[Problem | None, Kernel, dict[str, int]]:
    """Parse a .l2 file: an optional `gemm ...` problem line, then one kernel. Returns (problem, kernel, node lines)."""
    raw_problem, raw_kernel = _parse_tree(text, "kernel_file", filename)
    loc = _Located(text, filename)
    problem = loc.build_node(raw_problem, {"gemm": Problem}) if raw_problem is not None else None
    kernel, lines = loc.build_kernel(raw_kernel)
    if raw_problem is not None:
        lines["gemm"] = raw_problem.line      # so problem-rule errors point at the gemm line
    return problem, kernel, lines  # type: ignore[return-value]


def parse_kernel(text: str, filename: str | None = None) -> Kernel:
    return parse_kernel_file(text, filename)[1]


def parse_problem(text: str, filename: str | None = None) -> Problem:
    raw = _parse_tree(text, "problem_file", filename)
    return _Located(text, filename).build_node(raw, {"gemm": Problem})  # type: ignore[return-value]


def parse_node(text: str) -> Node:
    """Parse one node line such as 'mma op=wgmma shape=64x256x16'."""
    raw = _parse_tree(text, "problem_file", None)
    return _Located(text, None).build_node(raw, NODE_TYPES)


def parse_expr(text: str) -> Expr:
    return _parse_tree(text, "expr_only", None)


def parse_edits_raw(text: str, filename: str | None = None):
    """The raw edit tuples with positions; l2ir.edits turns them into typed Edit records."""
    return _parse_tree(text, "edit_list", filename), _Located(text, filename)


# ---------------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------------


def print_node(node: Node) -> str:
    parts = [node.kind]
    for fld in dataclasses.fields(node):
        parts.append(f"{fld.name}={fld.metadata['type'].render(getattr(node, fld.name))}")
    return " ".join(parts)


def print_value(node_cls: type[Node], field_name: str, value: Any) -> str:
    return node_cls.field_types()[field_name].render(value)


def print_kernel(kernel: Kernel) -> str:
    lines = ["kernel {"]
    for name in KERNEL_ORDER:
        node = getattr(kernel, name)
        if node is not None:
            lines.append("  " + print_node(node))
    lines.append("}")
    return "\n".join(lines) + "\n"


def print_problem(problem: Problem) -> str:
    return print_node(problem)


def print_problem_class(problem: Problem) -> str:
    """The compile-time part of a problem (dtypes, layouts, accumulator; not the sizes): 'a=f16:row b=f16:col ...'.
    A lowering depends on exactly this, which is why backends record it beside the source."""
    return " ".join(f"{fl.name}={fl.metadata['type'].render(getattr(problem, fl.name))}"
                    for fl in dataclasses.fields(problem) if fl.name not in ("m", "n", "k"))
