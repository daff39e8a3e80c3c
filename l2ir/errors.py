"""The one error hierarchy of L2IR.

Everything L2IR raises on bad input derives from `L2IRError`, so a search loop can catch one class, record the
message and prune the candidate. Verification errors name the node and the rule that failed; parse errors carry
a line and a column.
"""

from __future__ import annotations


class L2IRError(Exception):
    """Base class of every error L2IR raises on bad input."""


class ExprError(L2IRError):
    """An index or launch expression is ill-formed or cannot be evaluated."""


class ParseError(L2IRError):
    """Text that does not follow the grammar, or a value of the wrong type for its field."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None,
                 source_line: str | None = None, filename: str | None = None):
        self.message = message
        self.line = line
        self.column = column
        self.source_line = source_line
        self.filename = filename
        super().__init__(self._render())

    def _render(self) -> str:
        if self.filename is None and self.line is None:
            return self.message   # a value checked outside any text (a constructor or an edit)
        where = self.filename or "<input>"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        text = f"{where}: {self.message}"
        if self.source_line is not None and self.column is not None:
            text += f"\n    {self.source_line}\n    {' ' * (self.column - 1)}^"
        return text

    def with_filename(self, filename: str) -> "ParseError":
        return ParseError(self.message, self.line, self.column, self.source_line, filename)


class VerifyError(L2IRError):
    """An illegal schedule. `node` is the node kind ('tile', 'mma', ...), `rule` the rule's name."""

    def __init__(self, node: str, rule: str, message: str):
        self.node = node
        self.rule = rule
        self.message = message
        super().__init__(f"{node}: {message} [rule {rule}]")


class ProblemError(VerifyError):
    """The problem spec itself is invalid (sizes, dtypes, layouts)."""


class TargetError(VerifyError):
    """An instruction or feature the target does not have (wgmma, TMA, clusters on sm80)."""


class TileError(VerifyError):
    """Block tile, warp layout or cluster shape inconsistent with each other or with the MMA instruction."""


class MmaError(VerifyError):
    """An MMA instruction shape that does not exist or does not fit the problem's dtypes."""


class ResourceError(VerifyError):
    """Shared-memory or register budget exceeded for the target."""


class PipelineError(VerifyError):
    """Stage count, pipeline kind or schedule illegal for the rest of the kernel."""


class SwizzleError(VerifyError):
    """Shared-memory swizzle or block rasterization illegal for the tile."""


class PadError(VerifyError):
    """Padding, divisibility or alignment requirements that the kernel or the problem violate."""


class SplitKError(VerifyError):
    """Split-K / stream-K settings illegal for the kernel or the problem's K."""


class EpilogueError(VerifyError):
    """An epilogue store path or vector width that the target or alignment does not allow."""


class SourceError(VerifyError):
    """A free-form CUDA Source node that is ill-formed (entry point, launch expressions, code)."""


class EditError(L2IRError):
    """An edit that names a missing node or field, or cannot be applied to this kernel."""


class LoweringError(L2IRError):
    """A backend failed to lower a legal kernel for a reason other than an unsupported feature (which is a
    NotImplementedError naming the field); the message carries the kernel's IR text."""


class UnsupportedLowering(L2IRError, NotImplementedError):
    """The IR is legal but asks for something a backend does not generate. `field` names the IR field (e.g.
    'epilogue.path'). Both a NotImplementedError and an L2IRError, so search prunes it like any other error."""

    def __init__(self, backend: str, field: str, message: str):
        self.backend = backend
        self.field = field
        super().__init__(f"{backend}: {field}: {message}")


class InterpError(L2IRError):
    """The reference interpreter found a schedule that does not compute A @ B (unwritten or twice-written output)."""
