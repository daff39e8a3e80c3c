"""The typed IR: one frozen dataclass per node kind, the problem spec and the kernel.

A node's fields carry their own type (`FieldType`), which is the single schema used by the parser (to convert and
check values, with a located error), the printer (to render values canonically) and the edits (`set tile.block =
128x256x64` converts through the same type). Nodes are frozen, so structural equality and hashing give dedup for
free; `Kernel.content_hash()` hashes the canonical text, so it is stable across processes and machines.

A kernel is problem-independent: M, N, K are run-time arguments. The problem's dtypes and layouts are compile-time
properties of a lowering, not of the schedule.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import ParseError
from .indexing import Expr
from .target import NVCC_ARCH

# ---------------------------------------------------------------------------------------------------------------
# Field types: convert a parsed raw value (kind, payload) into a typed value, and render it back.
# ---------------------------------------------------------------------------------------------------------------


class FieldType:
    """What values a field takes. `convert` raises ValueError with a short reason; the parser adds the location."""

    describe: str = "a value"

    def convert(self, kind: str, payload: Any) -> Any:
        raise NotImplementedError

    def render(self, value: Any) -> str:
        raise NotImplementedError

    def check(self, value: Any) -> Any:
        """Validate an already-typed value (constructor path); returns it or raises ValueError."""
        return self.convert(*raw_of(value))


def raw_of(value: Any) -> tuple[str, Any]:
    """The raw (kind, payload) a typed value would have come from, so constructors check like the parser."""
    if isinstance(value, bool):
        return "name", "true" if value else "false"
    if isinstance(value, int):
        return "int", value
    if isinstance(value, str):
        return "name", value
    if value is None:
        return "name", "none"
    if isinstance(value, tuple) and value and all(isinstance(v, Expr) for v in value):
        return "exprs", value
    if isinstance(value, tuple):
        return "tuple", value
    return "other", value


@dataclass(frozen=True)
class Int(FieldType):
    lo: int = 0
    hi: int = 1 << 31

    @property
    def describe(self):
        return f"an integer in [{self.lo}, {self.hi}]"

    def convert(self, kind, payload):
        if kind != "int" or isinstance(payload, bool):
            raise ValueError(f"expected {self.describe}")
        if not self.lo <= payload <= self.hi:
            raise ValueError(f"{payload} is out of range: expected {self.describe}")
        return payload

    def render(self, value):
        return str(value)


@dataclass(frozen=True)
class IntOrAuto(Int):
    @property
    def describe(self):
        return f"'auto' or an integer in [{self.lo}, {self.hi}]"

    def convert(self, kind, payload):
        if kind == "name" and payload == "auto":
            return "auto"
        return super().convert(kind, payload)


@dataclass(frozen=True)
class IntChoice(FieldType):
    choices: tuple[int, ...]

    @property
    def describe(self):
        return "one of " + ", ".join(map(str, self.choices))

    def convert(self, kind, payload):
        if kind != "int" or payload not in self.choices:
            raise ValueError(f"expected {self.describe}")
        return payload

    def render(self, value):
        return str(value)


@dataclass(frozen=True)
class Choice(FieldType):
    choices: tuple[str, ...]

    @property
    def describe(self):
        return "one of " + ", ".join(self.choices)

    def convert(self, kind, payload):
        if kind != "name" or payload not in self.choices:
            got = f" (got '{payload}')" if kind == "name" else ""
            raise ValueError(f"expected {self.describe}{got}")
        return payload

    def render(self, value):
        return value


@dataclass(frozen=True)
class Bool(FieldType):
    describe = "true or false"

    def convert(self, kind, payload):
        if kind == "name" and payload in ("true", "false"):
            return payload == "true"
        raise ValueError("expected true or false")

    def render(self, value):
        return "true" if value else "false"


@dataclass(frozen=True)
class Dims(FieldType):
    n: int
    lo: int = 1
    hi: int = 4096

    @property
    def describe(self):
        return "dims like " + "x".join(["128", "64", "32", "1"][: self.n])

    def convert(self, kind, payload):
        if kind == "int" and self.n == 1:
            payload = (payload,)
        elif kind != "tuple" or len(payload) != self.n or \
                not all(isinstance(v, int) and not isinstance(v, bool) for v in payload):
            raise ValueError(f"expected {self.describe}")
        for v in payload:
            if not self.lo <= v <= self.hi:
                raise ValueError(f"dimension {v} out of range [{self.lo}, {self.hi}]")
        return tuple(payload)

    def render(self, value):
        return "x".join(map(str, value))


@dataclass(frozen=True)
class SwizzleBits(FieldType):
    """CuTe Swizzle<B,M,S>, or none."""

    describe = "a swizzle like <3,3,3>, or none"

    def convert(self, kind, payload):
        if kind == "name" and payload == "none":
            return None
        if kind in ("swizzle", "tuple") and len(payload) == 3 and all(isinstance(v, int) for v in payload):
            b, m, s = payload
            if not (0 <= b <= 3 and 0 <= m <= 4 and 0 <= s <= 4):
                raise ValueError(f"swizzle <{b},{m},{s}> out of range: B in 0..3, M in 0..4, S in 0..4")
            return tuple(payload)
        raise ValueError(f"expected {self.describe}")

    def check(self, value):
        return self.convert("name", "none") if value is None else self.convert("swizzle", value)

    def render(self, value):
        return "none" if value is None else "<{},{},{}>".format(*value)


@dataclass(frozen=True)
class Ident(FieldType):
    describe = "a C identifier"

    def convert(self, kind, payload):
        if kind in ("name", "string") and isinstance(payload, str) and payload.isidentifier() and payload.isascii():
            return payload
        raise ValueError("expected a C identifier")

    def render(self, value):
        return value


@dataclass(frozen=True)
class ExprTuple(FieldType):
    n: int

    @property
    def describe(self):
        return f"a tuple of {self.n} expressions of m, n, k like (cdiv(n, 128), cdiv(m, 128), 1)"

    def convert(self, kind, payload):
        if kind == "exprs" and len(payload) == self.n:
            return tuple(payload)
        raise ValueError(f"expected {self.describe}")

    def render(self, value):
        return "(" + ", ".join(str(e) for e in value) + ")"


@dataclass(frozen=True)
class Code(FieldType):
    describe = "a fenced code block (``` on its own lines)"

    def convert(self, kind, payload):
        if kind in ("code", "name") and isinstance(payload, str):
            if "\n```" in "\n" + payload:
                raise ValueError("the code has a line starting with ```, which would end its fenced block")
            return payload
        raise ValueError(f"expected {self.describe}")

    def render(self, value):
        return "```\n" + value + "\n```"


@dataclass(frozen=True)
class Operand(FieldType):
    """dtype:layout, e.g. f16:row."""

    dtypes: tuple[str, ...]
    layouts: tuple[str, ...]

    @property
    def describe(self):
        return f"dtype:layout with dtype in {'/'.join(self.dtypes)} and layout in {'/'.join(self.layouts)}"

    def convert(self, kind, payload):
        if kind == "pair" or kind == "tuple" and len(payload) == 2:
            dt, lay = payload
            if dt in self.dtypes and lay in self.layouts:
                return (dt, lay)
        raise ValueError(f"expected {self.describe}")

    def render(self, value):
        return f"{value[0]}:{value[1]}"


def f(ftype: FieldType, default: Any = dataclasses.MISSING, doc: str = "") -> Any:
    """A node field with its type (and an optional default)."""
    return field(default=default, metadata={"type": ftype, "doc": doc})


class Node:
    """Mixin for IR nodes: the node's keyword in the text format and its typed fields."""

    kind: ClassVar[str]

    def __post_init__(self):
        for fld in dataclasses.fields(self):
            ftype: FieldType = fld.metadata["type"]
            value = getattr(self, fld.name)
            try:
                checked = ftype.check(value)
            except ValueError as e:
                raise ParseError(f"{self.kind}.{fld.name}: {e}") from None
            object.__setattr__(self, fld.name, checked)

    @classmethod
    def field_types(cls) -> dict[str, FieldType]:
        return {fl.name: fl.metadata["type"] for fl in dataclasses.fields(cls)}

    @classmethod
    def required_fields(cls) -> list[str]:
        return [fl.name for fl in dataclasses.fields(cls)
                if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING]


# ---------------------------------------------------------------------------------------------------------------
# The problem.
# ---------------------------------------------------------------------------------------------------------------

DTYPES_IN = ("f16", "bf16")
DTYPES_OUT = ("f16", "bf16", "f32")


@dataclass(frozen=True)
class Problem(Node):
    """gemm m=.. n=.. k=.. a=f16:row b=f16:col c=f16:row acc=f32.

    A is MxK (row = K contiguous); B is KxN, stored row (N contiguous) or col (the "TN" NxK form, K contiguous);
    C is MxN row-major. fp16 in/out with fp32 accumulation is the contract; acc=f16 is an explicit variant.
    """

    kind: ClassVar[str] = "gemm"
    # The kernel ABI passes M, N, K as 32-bit ints.
    m: int = f(Int(1, (1 << 31) - 1))
    n: int = f(Int(1, (1 << 31) - 1))
    k: int = f(Int(1, (1 << 31) - 1))
    a: tuple[str, str] = f(Operand(DTYPES_IN, ("row", "col")), ("f16", "row"))
    b: tuple[str, str] = f(Operand(DTYPES_IN, ("row", "col")), ("f16", "col"))
    c: tuple[str, str] = f(Operand(DTYPES_OUT, ("row",)), ("f16", "row"))
    acc: str = f(Choice(("f32", "f16")), "f32")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.m, self.n, self.k)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def with_shape(self, m: int, n: int, k: int) -> "Problem":
        return dataclasses.replace(self, m=m, n=n, k=k)


# ---------------------------------------------------------------------------------------------------------------
# Kernel nodes.
# ---------------------------------------------------------------------------------------------------------------

# The archs L2IR targets: those with an nvcc spelling and shared-memory limit in l2ir.target.
ARCHS = tuple(NVCC_ARCH)


@dataclass(frozen=True)
class Target(Node):
    """The GPU architecture the kernel is built for. sm90a adds wgmma and setmaxnreg to sm90."""

    kind: ClassVar[str] = "target"
    arch: str = f(Choice(ARCHS))

    @property
    def is_hopper(self) -> bool:
        return self.arch in ("sm90", "sm90a")


@dataclass(frozen=True)
class Tile(Node):
    """Block tile BMxBNxBK, the warp layout over (M, N), and the thread-block cluster (M, N).

    With wgmma, four consecutive warps (one warpgroup) stack along M and share a 64-row wgmma, so warps=8x1 is two
    consumer warpgroups along M (CUTLASS's cooperative 128xN tile), or, with splitk reduce=block, two warpgroups
    over the same rows that split the K loop.
    """

    kind: ClassVar[str] = "tile"
    block: tuple[int, int, int] = f(Dims(3, 8, 512))
    warps: tuple[int, int] = f(Dims(2, 1, 16))
    cluster: tuple[int, int] = f(Dims(2, 1, 8), (1, 1))

    @property
    def bm(self) -> int:
        return self.block[0]

    @property
    def bn(self) -> int:
        return self.block[1]

    @property
    def bk(self) -> int:
        return self.block[2]

    @property
    def num_warps(self) -> int:
        return self.warps[0] * self.warps[1]


@dataclass(frozen=True)
class Mma(Node):
    """The tensor-core instruction: mma.sync m16n8k16 (sm80+) or wgmma m64nNk16 (sm90a)."""

    kind: ClassVar[str] = "mma"
    op: str = f(Choice(("mma_sync", "wgmma")))
    shape: tuple[int, int, int] = f(Dims(3, 1, 256))


@dataclass(frozen=True)
class Pipeline(Node):
    """How tiles flow global -> shared -> registers.

    multistage: cp.async ring of `stages` shared-memory buffers (sm80 style); prefetch=true double-buffers the
                ldmatrix fragments in registers so the next k-step's loads overlap this one's MMAs.
    tma_ws:     TMA bulk tensor copies by a producer warpgroup, mbarrier-synchronized with consumer warpgroups
                (schedule cooperative or pingpong); stages=auto fills the shared memory left after the epilogue.
    direct:     no shared memory for operands: every lane loads its mma.sync fragments from global memory into
                registers (l2ir.indexing.DirectFeed), for few rows of A (decode), where the kernel streams B once
                at DRAM speed; stages = k steps of A and B vectors in registers at once (1 to 4).
    persistent: one block per SM loops over output tiles (the CUTLASS persistent tile scheduler).
    """

    kind: ClassVar[str] = "pipeline"
    mode: str = f(Choice(("multistage", "tma_ws", "direct")))
    stages: int | str = f(IntOrAuto(1, 16))
    schedule: str = f(Choice(("none", "cooperative", "pingpong")), "none")
    prefetch: bool = f(Bool(), False)
    persistent: bool = f(Bool(), False)


@dataclass(frozen=True)
class Swizzle(Node):
    """Shared-memory swizzle <B,M,S> (or none) and block rasterization (order and group size, in tiles)."""

    kind: ClassVar[str] = "swizzle"
    smem: tuple[int, int, int] | None = f(SwizzleBits(), None)
    raster: str = f(Choice(("along_m", "along_n")), "along_n")
    group: int = f(Int(1, 256), 1)


@dataclass(frozen=True)
class Pad(Node):
    """How each dimension handles a problem that is not a multiple of the tile, and the assumed alignment.

    predicate: out-of-range loads are skipped and the MMA/store is masked (residue handled in the last tile);
    zero_fill: out-of-range loads fill zeros (cp.async src-size 0 / TMA OOB fill) and the math runs full width;
    divisible: the kernel requires the dimension to be a multiple of the tile (no bounds checks at all).
    align: elements per 16-byte-or-smaller vector the kernel assumes every leading dimension is a multiple of.
    """

    kind: ClassVar[str] = "pad"
    m: str = f(Choice(("predicate", "zero_fill", "divisible")), "predicate")
    n: str = f(Choice(("predicate", "zero_fill", "divisible")), "predicate")
    k: str = f(Choice(("predicate", "zero_fill", "divisible")), "zero_fill")
    align: int = f(IntChoice((1, 2, 4, 8)), 8)


@dataclass(frozen=True)
class Repack(Node):
    """Copy operands whose rows are not 16-byte aligned into the workspace first, so the GEMM keeps its wide loads.

    An odd K leaves every row of a K-major A and B on a 2-byte boundary: TMA (16-byte strides) and 16-byte cp.async
    cannot read them, and a narrow-load path runs at a fraction of the tensor cores' rate. With this node, an
    operand in `operands` whose leading dimension is not a multiple of 8 elements is copied, at run time, by a
    small kernel launched before the GEMM into rows padded to a multiple of 8 (l2ir.indexing.Repack: the copy's
    layout and the workspace it takes); the GEMM then reads the copy. An aligned operand is read in place, so the
    same kernel runs aligned shapes at no extra cost."""

    kind: ClassVar[str] = "repack"
    operands: str = f(Choice(("a", "b", "ab")), "ab")


@dataclass(frozen=True)
class Interleave(Node):
    """Give each block columns of C `n` apart, so that the rows of a K-major B it reads all start at one alignment.

    Row j of a K-major B starts at element j*K. With K not a multiple of 8 the rows start on every 2-byte offset of
    a 16-byte vector in turn, so a block of consecutive columns must realign every row of B before the tensor cores
    read it. Rows j = r, r + 8, r + 16, ... start at the same offset o = (r*K) mod 8 (8K elements apart is 16K
    bytes): read from o elements before each row start, they are an aligned matrix with row pitch 8K, loaded with
    whole 16-byte copies, and only A (M rows, few where this pays) is realigned, shifted by o to meet it. A block
    then takes BN columns of one residue r of n mod 8 (l2ir.indexing.Interleave): its stores are 8 columns apart.
    On a cp.async ring (cuda_ptx_sm80) or a TMA ring (cuda_ptx: the view one tensor map, A's stages written by
    the producer warpgroup's other warps, C's last N mod 8 columns a tail of dot products)."""

    kind: ClassVar[str] = "interleave"
    n: int = f(IntChoice((8,)), 8, "columns of one block are n apart (the 8 elements of a 16-byte vector)")


@dataclass(frozen=True)
class SplitK(Node):
    """split_k: `slices` blocks share one output tile along K; their fp32 partials are reduced and one sum written
    to C: through a workspace (reduce=workspace: a fixed-order reduction, in the GEMM kernel or a second one), fp32
    atomics (reduce=atomic), or, on sm90, inside one thread-block cluster of the tile's `slices` blocks, which add
    each other's partials from distributed shared memory (reduce=cluster: no workspace, no atomics; see
    l2ir.indexing.ClusterReduce), or inside one block whose two consumer warpgroups each take one of 2 slices of
    the tile's K loop from one shared stage ring and add each other's partials through shared memory (reduce=block;
    see l2ir.indexing.BlockSplit).
    stream_k: a persistent grid splits the total MAC-loop iterations evenly over the SMs; tiles cut between two
    blocks are fixed up through the workspace. `slices` caps the pieces per tile (1 = scheduler heuristic)."""

    kind: ClassVar[str] = "splitk"
    mode: str = f(Choice(("split_k", "stream_k")))
    slices: int = f(Int(1, 64), 1)
    reduce: str = f(Choice(("workspace", "atomic", "cluster", "block")), "workspace")


@dataclass(frozen=True)
class Epilogue(Node):
    """How accumulators reach C: direct register stores, staged through shared memory (coalesced, vectorized),
    or a TMA store (sm90). `vector` is the elements per store instruction."""

    kind: ClassVar[str] = "epilogue"
    path: str = f(Choice(("direct", "smem", "tma")), "smem")
    vector: int = f(IntChoice((1, 2, 4, 8)), 8)


SOURCE_ABI = ("const void* A, const void* B, void* C, int M, int N, int K, void* workspace")


@dataclass(frozen=True)
class Source(Node):
    """Free-form CUDA (e.g. written by an LLM). The harness launches `entry` with the fixed L2IR ABI
    `extern "C" __global__ void entry(const void* A, const void* B, void* C, int M, int N, int K, void* workspace)`
    over `grid` (expressions of m, n, k) and `block`, with `smem` bytes of dynamic shared memory."""

    kind: ClassVar[str] = "source"
    entry: str = f(Ident())
    grid: tuple[Expr, Expr, Expr] = f(ExprTuple(3))
    block: tuple[int, int, int] = f(Dims(3, 1, 1024))
    smem: int = f(Int(0, 1 << 20))
    code: str = f(Code())


NODE_TYPES: dict[str, type[Node]] = {
    cls.kind: cls for cls in (Target, Tile, Mma, Pipeline, Swizzle, Pad, Repack, Interleave, SplitK, Epilogue, Source)
}

# Print order of a kernel's nodes, and which nodes may be absent (absent = the node's default behaviour).
KERNEL_ORDER = ("target", "tile", "mma", "pipeline", "swizzle", "pad", "repack", "interleave", "splitk", "epilogue",
                "source")
SCHEDULE_NODES = ("tile", "mma", "pipeline", "pad", "epilogue")   # required unless the kernel is a Source kernel
OPTIONAL_NODES = ("swizzle", "repack", "interleave", "splitk")      # may be inserted and removed freely


@dataclass(frozen=True)
class Kernel:
    """A problem-independent kernel: a Target plus either a schedule (tile, mma, pipeline, pad, epilogue and the
    optional swizzle, repack, interleave and splitk) or a Source node. A Swizzle equal to its defaults is stored as absent, so each
    schedule has exactly one representation."""

    target: Target
    tile: Tile | None = None
    mma: Mma | None = None
    pipeline: Pipeline | None = None
    swizzle: Swizzle | None = None
    pad: Pad | None = None
    splitk: SplitK | None = None
    epilogue: Epilogue | None = None
    source: Source | None = None
    repack: Repack | None = None     # last, so positional construction of the older fields is unchanged
    interleave: Interleave | None = None

    def __post_init__(self):
        for name in KERNEL_ORDER:
            node = getattr(self, name)
            expected = NODE_TYPES[name]
            if node is not None and not isinstance(node, expected):
                raise TypeError(f"Kernel.{name} must be a {expected.__name__}, got {type(node).__name__}")
        if self.swizzle is not None and self.swizzle == Swizzle():
            object.__setattr__(self, "swizzle", None)

    @property
    def is_source(self) -> bool:
        return self.source is not None

    def nodes(self) -> list[Node]:
        return [getattr(self, name) for name in KERNEL_ORDER if getattr(self, name) is not None]

    def text(self) -> str:
        from .text import print_kernel

        return print_kernel(self)

    def content_hash(self) -> str:
        """sha256 of the canonical text: identical across processes, machines and Python versions."""
        return hashlib.sha256(self.text().encode()).hexdigest()

    @property
    def short_hash(self) -> str:
        return self.content_hash()[:12]

    def replace(self, **changes) -> "Kernel":
        return dataclasses.replace(self, **changes)
