"""Index functions written once, evaluated in Python and rendered to C++.

Every piece of index arithmetic that a backend emits (block rasterization, shared-memory swizzle, split-K
partition, the launch geometry of a Source kernel) is built here as a small expression tree. The reference
interpreter evaluates the very same tree, on Python ints or on numpy integer arrays (which is how the
bijection properties are checked over a whole domain at once), and the backends call `to_cpp()` on it.
So the arithmetic the interpreter checks is, character for character, the arithmetic the GPU runs.

All quantities are non-negative integers, so C++ `/` and `%` agree with Python `//` and `%`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import numpy as np

from .errors import ExprError

Value = Union[int, np.ndarray]


class Expr:
    """Base of the expression tree. Operators build new trees, so index functions read like arithmetic."""

    def eval(self, env: Mapping[str, Value]) -> Value:
        raise NotImplementedError

    def to_cpp(self) -> str:
        raise NotImplementedError

    def free_vars(self) -> frozenset[str]:
        raise NotImplementedError

    # Operator sugar; ints are lifted to Const.
    def __add__(self, o): return Bin("+", self, lift(o))
    def __radd__(self, o): return Bin("+", lift(o), self)
    def __sub__(self, o): return Bin("-", self, lift(o))
    def __rsub__(self, o): return Bin("-", lift(o), self)
    def __mul__(self, o): return Bin("*", self, lift(o))
    def __rmul__(self, o): return Bin("*", lift(o), self)
    def __floordiv__(self, o): return Bin("/", self, lift(o))
    def __rfloordiv__(self, o): return Bin("/", lift(o), self)
    def __mod__(self, o): return Bin("%", self, lift(o))
    def __xor__(self, o): return Bin("^", self, lift(o))
    def __and__(self, o): return Bin("&", self, lift(o))
    def __rshift__(self, o): return Bin(">>", self, lift(o))
    def __lshift__(self, o): return Bin("<<", self, lift(o))


@dataclass(frozen=True)
class Const(Expr):
    value: int

    def __post_init__(self):
        if self.value < 0:
            raise ExprError(f"constant {self.value}: index expressions use non-negative constants (write m - 1, "
                            "not m + -1)")

    def eval(self, env):
        return self.value

    def to_cpp(self):
        return str(self.value)

    def free_vars(self):
        return frozenset()

    def __str__(self):
        return str(self.value)


@dataclass(frozen=True)
class Var(Expr):
    name: str

    def eval(self, env):
        try:
            return env[self.name]
        except KeyError:
            raise ExprError(f"unbound variable '{self.name}' (bound: {', '.join(sorted(env)) or 'none'})") from None

    def to_cpp(self):
        return self.name

    def free_vars(self):
        return frozenset({self.name})

    def __str__(self):
        return self.name


def _non_negative(op: str, *values) -> None:
    """Index arithmetic is on non-negative integers: there C++ `/`, `%` and shifts agree with Python's."""
    for v in values:
        if np.any(np.asarray(v) < 0):
            raise ExprError(f"'{op}' on a negative value: index expressions must stay non-negative "
                            "(C++ and Python disagree on negative division, modulo and shifts)")


def _div(a, b):
    _non_negative("/", a, b)
    if np.any(np.asarray(b) == 0):
        raise ExprError("division by zero in index expression")
    return a // b


def _mod(a, b):
    _non_negative("%", a, b)
    if np.any(np.asarray(b) == 0):
        raise ExprError("modulo by zero in index expression")
    return a % b


def _shift(op: str):
    def apply(a, b):
        _non_negative(op, a, b)
        if np.any(np.asarray(b) > 62):
            raise ExprError(f"shift by more than 62 bits in '{op}': the value would not fit a 64-bit index")
        return a << b if op == "<<" else a >> b
    return apply


_BIN_EVAL = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _div,
    "%": _mod,
    "^": lambda a, b: a ^ b,
    "&": lambda a, b: a & b,
    ">>": _shift(">>"),
    "<<": _shift("<<"),
}

# Precedence for printing with the fewest parentheses that still parse back the same tree.
_PREC = {"+": 3, "-": 3, "*": 4, "/": 4, "%": 4, "<<": 2, ">>": 2, "&": 1, "^": 0}


@dataclass(frozen=True)
class Bin(Expr):
    op: str
    a: Expr
    b: Expr

    def eval(self, env):
        return _BIN_EVAL[self.op](self.a.eval(env), self.b.eval(env))

    def to_cpp(self):
        return f"({self.a.to_cpp()} {self.op} {self.b.to_cpp()})"

    def free_vars(self):
        return self.a.free_vars() | self.b.free_vars()

    def __str__(self):
        p = _PREC[self.op]
        left = _wrap(self.a, p, right=False)
        right = _wrap(self.b, p, right=True)
        return f"{left} {self.op} {right}"


def _wrap(e: Expr, parent_prec: int, right: bool) -> str:
    if isinstance(e, Bin):
        p = _PREC[e.op]
        # Left-associative operators: an equal-precedence child on the right needs parentheses.
        if p < parent_prec or (right and p == parent_prec):
            return f"({e})"
    return str(e)


_CALLS = {
    "min": (2, lambda a, b: np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)),
    "max": (2, lambda a, b: np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)),
    "cdiv": (2, lambda a, b: _div(a + b - 1, b)),
}


@dataclass(frozen=True)
class Call(Expr):
    fn: str
    args: tuple[Expr, ...]

    def __post_init__(self):
        if self.fn not in _CALLS:
            raise ExprError(f"unknown function '{self.fn}' (known: {', '.join(sorted(_CALLS))})")
        arity = _CALLS[self.fn][0]
        if len(self.args) != arity:
            raise ExprError(f"{self.fn}() takes {arity} arguments, got {len(self.args)}")

    def eval(self, env):
        return _CALLS[self.fn][1](*(a.eval(env) for a in self.args))

    def to_cpp(self):
        a = [x.to_cpp() for x in self.args]
        if self.fn == "cdiv":
            return f"(({a[0]} + {a[1]} - 1) / {a[1]})"
        return f"{self.fn}({a[0]}, {a[1]})"

    def free_vars(self):
        out = frozenset()
        for x in self.args:
            out |= x.free_vars()
        return out

    def __str__(self):
        return f"{self.fn}({', '.join(str(x) for x in self.args)})"


def ceil_div(a: int, b: int) -> int:
    """Python-side ceil(a / b) for non-negative ints (tile counts); `cdiv` builds the same as an expression."""
    return -(-a // b)


def lift(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return Const(int(x))
    raise ExprError(f"cannot use {x!r} in an index expression")


def emin(a, b) -> Expr:
    return Call("min", (lift(a), lift(b)))


def cdiv(a, b) -> Expr:
    return Call("cdiv", (lift(a), lift(b)))


# ---------------------------------------------------------------------------------------------------------------
# The index functions the schedule uses.
# ---------------------------------------------------------------------------------------------------------------

PID, TILES_M, TILES_N = Var("pid"), Var("tiles_m"), Var("tiles_n")


def rasterize(order: str, group: int) -> tuple[Expr, Expr]:
    """Linear block id `pid` -> (tile_m, tile_n), over a tiles_m x tiles_n grid of output tiles.

    along_n: strips of `group` tile-rows (in M); inside a strip consecutive blocks step through the strip's rows
             first, then move along N. group=1 is plain row-major order (N fastest).
    along_m: the transpose: strips of `group` tile-columns (in N), M-direction strips.
             group=1 is column-major order (M fastest).
    Grouping keeps the A and B tiles of blocks that run at the same time inside L2. The last strip may be
    narrower than `group`, which the min() handles, so the map is a bijection for every grid size.
    """
    if group < 1:
        raise ExprError(f"raster group must be >= 1, got {group}")
    if order == "along_n":
        major, minor = TILES_M, TILES_N
    elif order == "along_m":
        major, minor = TILES_N, TILES_M
    else:
        raise ExprError(f"unknown raster order '{order}' (expected along_m or along_n)")
    g = Const(group)
    per_strip = g * minor
    strip = PID // per_strip
    first = strip * g
    width = emin(major - first, g)
    local = PID % per_strip
    idx_major = first + local % width
    idx_minor = local // width
    if order == "along_n":
        return idx_major, idx_minor
    return idx_minor, idx_major



def substitute(expr: Expr, values: Mapping[str, Expr]) -> Expr:
    """`expr` with each variable named in `values` replaced by its expression (the others kept)."""
    if isinstance(expr, Var):
        return values.get(expr.name, expr)
    if isinstance(expr, Bin):
        return Bin(expr.op, substitute(expr.a, values), substitute(expr.b, values))
    if isinstance(expr, Call):
        return Call(expr.fn, tuple(substitute(a, values) for a in expr.args))
    return expr


RANK = Var("rank")
UNIT = Var("unit")


@dataclass(frozen=True)
class ClusterMulticast:
    """tile.cluster = CM x CN with one output tile per block (pipeline.persistent=false): the CM x CN blocks of a
    cluster own a CM x CN patch of output tiles, and TMA multicast lets each fetch only a share of its operands.

    The CN blocks of a patch row (same tile_m) need the same A tile; the CM blocks of a patch column (same tile_n)
    the same B tile. Each block loads 1/CN of the A box's rows (`a_first`, `a_rows`) and writes them into the
    shared memory of every block of its row (`a_mask`), and 1/CM of the B box's rows into every block of its
    column (`b_mask`). Every block still receives the whole A and B box of each k tile (each row from exactly one
    block), so its stage's full barrier expects the same bytes as without a cluster; L2 serves each operand row
    once per patch row or column instead of once per block.

    Blocks: cluster `pid / SIZE` (rasterized over the ceil(tiles_m / CM) x ceil(tiles_n / CN) patch grid), rank
    `pid % SIZE` (%cluster_ctarank of a 1-D cluster of SIZE consecutive blocks), position in the patch (rank % CM,
    rank / CM) (`tile`). A block whose tile lies past the grid (tiles_m or tiles_n not a multiple of CM or CN) still
    loads its share for the others and runs the K loop; it only stores nothing.

    With split-K (reduce=workspace) the launch is SLICES copies of that grid, one K slice after another (`unit`):
    block `unit` is block `unit % blocks()` of slice `unit / blocks()`. blocks() is whole clusters, so a cluster's
    blocks share one slice, load the same k tiles and can multicast them; each in-grid block then sums its tile's
    partials through the workspace tree (SplitKTree) like any split-K block, and a block past the grid only loads.

    A stage of block d is overwritten by every block that multicasts into it, so before a producer reuses stage s
    all of those blocks must have released it: each consumer warp arrives at stage s's empty barrier in every block
    of its row and column (`release_mask`, CM + CN - 1 blocks, itself included), and each empty barrier counts
    `release_arrivals` warp arrivals a phase."""

    cm: int
    cn: int

    def __post_init__(self):
        for d in (self.cm, self.cn):
            if d < 1 or d & (d - 1):
                raise ExprError(f"cluster {self.cm}x{self.cn}: each dimension must be a power of two")

    @property
    def size(self) -> int:
        return self.cm * self.cn

    def tile(self, order: str, group: int) -> tuple[Expr, Expr]:
        """Block id `pid` -> its (tile_m, tile_n): the cluster's patch by rasterize(order, group) over the patch
        grid, then the block's place in the patch."""
        pm, pn = rasterize(order, group)
        patch = {"pid": PID // self.size, "tiles_m": cdiv(TILES_M, self.cm), "tiles_n": cdiv(TILES_N, self.cn)}
        rank = PID % self.size
        return (substitute(pm, patch) * self.cm + rank % self.cm, substitute(pn, patch) * self.cn + rank // self.cm)

    def clusters(self) -> Expr:
        """Clusters in the grid (the launch has SIZE x this many blocks)."""
        return cdiv(TILES_M, self.cm) * cdiv(TILES_N, self.cn)

    def blocks(self) -> Expr:
        """Blocks of one slice's grid: whole clusters."""
        return Const(self.size) * self.clusters()

    def unit(self) -> tuple[Expr, Expr]:
        """split-K: launch block `unit` -> (pid, slice), slice after slice (see the class doc)."""
        return UNIT % self.blocks(), UNIT // self.blocks()

    @staticmethod
    def slot() -> Expr:
        """split-K: the workspace slot (partials and pair counters) of an in-grid block's tile. pid numbers the
        cluster grid, which has blocks past the tile grid, so the slot is the tile's own row-major index."""
        return Var("tile_m") * TILES_N + Var("tile_n")

    def a_first(self, bm: int) -> Expr:
        """First row of the A box that block `rank` loads (its column in the patch picks the share)."""
        return RANK // self.cm * (bm // self.cn)

    def a_rows(self, bm: int) -> int:
        return bm // self.cn

    def b_first(self, bn: int) -> Expr:
        """First row of the B box (BN x BK, K-major) that block `rank` loads (its row in the patch picks it)."""
        return RANK % self.cm * (bn // self.cm)

    def b_rows(self, bn: int) -> int:
        return bn // self.cm

    def a_mask(self) -> Expr:
        """Cluster ranks that receive block `rank`'s A rows: its patch row, ranks rank % CM + CM j."""
        row = sum(1 << (self.cm * j) for j in range(self.cn))
        return Const(row) << (RANK % self.cm)

    def b_mask(self) -> Expr:
        """Cluster ranks that receive block `rank`'s B rows: its patch column, ranks CM (rank / CM) + i."""
        return Const((1 << self.cm) - 1) << (RANK // self.cm * self.cm)

    def release_mask(self) -> Expr:
        """Ranks whose stages block `rank`'s own stages are filled from (its row and column): where its consumers
        release each stage. The two masks share only bit `rank`, which the XOR of both drops and the last term
        restores."""
        return self.a_mask() ^ self.b_mask() ^ (Const(1) << RANK)

    def release_arrivals(self, consumer_warps: int) -> int:
        """Arrivals that complete one phase of a stage's empty barrier: every consumer warp of CM + CN - 1 blocks."""
        return (self.cm + self.cn - 1) * consumer_warps


OFFSET = Var("offset")


def smem_swizzle(bits: int, base: int, shift: int) -> Expr:
    """CuTe's Swizzle<B,M,S> on an element offset: XOR the B bits at [M+S, M+S+B) into the bits at [M, M+B).

    With M=3 on 16-bit data the unit is a 16-byte vector (one cp.async / ldmatrix row), and the XOR spreads the
    rows of an 8x8 ldmatrix tile over all 32 banks. It is an involution, hence a bijection on every aligned block
    of 2^(B+M+S) elements.
    """
    if bits == 0:
        return OFFSET
    mask = ((1 << bits) - 1) << (base + shift)
    return OFFSET ^ ((OFFSET & mask) >> shift)


# epilogue.path=tma (the cuda_ptx sm90a rule): each consumer warpgroup stages its WG_M x BN block of C in shared
# memory as BN / TMA_STORE_BOX_COLS boxes of WG_M rows x 128 bytes (the widest row the 128-byte swizzle allows), each
# swizzled as TMA reads it (16-byte chunk XOR row % 8: the 8 rows a warp's fragment store touches land on all 32
# banks), and one thread stores each box with cp.async.bulk.tensor; the store clips rows past M and columns past N.
STAGE_ROW, STAGE_COL, BOX = Var("r"), Var("col"), Var("box")
TILE_M_, TILE_N_, CONSUMER_WG = Var("tile_m"), Var("tile_n"), Var("cw")
TMA_STORE_BOX_BYTES = 128


def tma_store_box_cols(elem_bytes: int) -> int:
    """Columns of C in one store box (64 for fp16/bf16)."""
    return TMA_STORE_BOX_BYTES // elem_bytes


def tma_store_staging(wg_m: int, box_cols: int) -> Expr:
    """Element offset, in a warpgroup's staging buffer, of row `r`, column `col` of its WG_M x BN block: box
    col / box_cols, then the row, then the 16-byte chunk XORed with r % 8 (TMA's SWIZZLE_128B on 2-byte data; a
    bijection on each box, whose buffers start on 1024-byte boundaries)."""
    within = STAGE_ROW * box_cols + STAGE_COL % box_cols
    return (STAGE_COL // box_cols) * (wg_m * box_cols) + substitute(smem_swizzle(3, 3, 3), {"offset": within})


def tma_store_origin(bm: int, bn: int, wg_m: int, box_cols: int) -> tuple[Expr, Expr]:
    """(row, column) of C where box `box` of consumer warpgroup `cw` of tile (tile_m, tile_n) starts."""
    return TILE_M_ * bm + CONSUMER_WG * wg_m, TILE_N_ * bn + BOX * box_cols


SLICE, K_TILES = Var("slice"), Var("k_tiles")


def splitk_range(slices: int, slice_: Expr = SLICE) -> tuple[Expr, Expr]:
    """Split-K partition: slice `slice` of `slices` owns k tiles [begin, end) of k_tiles; the ranges tile [0, k_tiles).
    `slice_` is the expression that names the slice (the variable `slice` unless a schedule derives it).

    Each slice gets cdiv(k_tiles, slices) tiles except the tail; a slice whose range is empty still writes a zero
    partial, so the reduction never reads unwritten workspace.
    """
    per = cdiv(K_TILES, slices)
    begin = emin(slice_ * per, K_TILES)
    end = emin(begin + per, K_TILES)
    return begin, end


def leaves_empty_slice(k_tiles: int, slices: int) -> bool:
    """True when splitk_range gives some slice no k tile (the last one: the ranges are in order). Every split-K
    slice must own a k tile; the verifier refuses such a split and the seeds and rules pick fewer slices."""
    begin, _ = splitk_range(slices)
    return int(begin.eval({"slice": slices - 1, "k_tiles": k_tiles})) >= k_tiles


LEVEL, BASE = Var("level"), Var("base")


@dataclass(frozen=True)
class TreeStep:
    """One pairing on a block's way up the split-K tree: at `level` its subtree (slot `base`) meets the sibling
    subtree at slot `sibling` on counter `counter`; the sum belongs to the merged subtree, slot `merged`."""

    level: int
    base: int
    sibling: int
    counter: int
    merged: int


@dataclass(frozen=True)
class SplitKTree:
    """The deterministic pairwise reduction tree of `slices` split-K partials of one output tile.

    At level L the subtree whose lowest slice is `base` (a multiple of 2^L) pairs with its sibling subtree
    `base ^ (1 << L)`; the pair's sum is the subtree `base - (base & (1 << L))` at level L + 1 (the lower of the
    two bases). A subtree whose sibling does not exist (sibling >= slices, only for non-power-of-two counts) goes
    up a level unchanged. After `levels` = ceil(log2(slices)) levels one subtree, the root (base 0), holds the sum.

    Protocol (every backend that reduces in the kernel, and l2ir.interp's `_split_k`, which is its reference):
    a block starts with its slice's partial in registers, base = slice; at each level whose sibling exists it stores
    the registers to workspace slot `base`, fences (release) and counts itself in on the pair's counter (atomic
    add of 1). The first of the two arrivals is done with the tile; the second fences (acquire), adds slot
    `sibling` to its registers, resets the counter to 0 (self-cleaning: the next launch finds it zero) and goes on
    with base = `merged`. The block that finishes the last level runs the epilogue. fp32 addition is commutative,
    so every pair's sum has the same bits whichever of its two blocks arrives last: C is bit-identical run to run.
    No block ever waits for another; the critical path reads `levels` partials instead of `slices`.

    Counters: a pair node is named by its upper subtree's base h = merged + (1 << L), which is one of 1..slices-1
    exactly once (its lowest set bit is L), so counter = h - 1 numbers the slices - 1 nodes 0..slices-2.

    The expressions are of `level` and `base` (both ints, non-negative): the backends render them to C++, the
    interpreter and `steps()` evaluate the same trees.
    """

    slices: int

    def __post_init__(self):
        if self.slices < 2:
            raise ExprError(f"split-K tree of {self.slices} slice(s): a tree reduces at least 2")

    @property
    def levels(self) -> int:
        """ceil(log2(slices)): the pairings on the root's way up, the partial reads on the critical path."""
        return (self.slices - 1).bit_length()

    @property
    def counters(self) -> int:
        """Arrival counters per output tile: one per pair node, slices - 1."""
        return self.slices - 1

    @property
    def sibling(self) -> Expr:
        return BASE ^ (Const(1) << LEVEL)

    @property
    def merged(self) -> Expr:
        """The base (and workspace slot) of the pair's sum: the lower of the two subtrees' bases."""
        return BASE - (BASE & (Const(1) << LEVEL))

    @property
    def counter(self) -> Expr:
        """The pair node's counter among the tile's `counters` ones."""
        return self.merged + (Const(1) << LEVEL) - 1

    def steps(self, slice_: int) -> tuple[TreeStep, ...]:
        """The pairings a block that starts at `slice_` takes part in, in order, if it arrives second at each (it
        stops at the first pair where it arrives first). Evaluates the same expressions the backends render."""
        if not 0 <= slice_ < self.slices:
            raise ExprError(f"slice {slice_} outside 0..{self.slices - 1}")
        out, base = [], slice_
        for level in range(self.levels):
            env = {"level": level, "base": base}
            sibling = int(self.sibling.eval(env))
            if sibling >= self.slices:
                continue
            merged = int(self.merged.eval(env))
            out.append(TreeStep(level, base, sibling, int(self.counter.eval(env)), merged))
            base = merged
        return tuple(out)

    def slot_writes(self) -> tuple[int, ...]:
        """Times one launch writes each workspace slot of a tile, from the tree's shape alone (not from `steps`, so
        a checker can hold the protocol to it): subtree (L, s) is stored to slot s once when its sibling exists.
        Slot 0 is rewritten with every lower subtree's sum up to the root's children; odd slots are written once."""
        return tuple(sum(1 for level in range(self.levels)
                         if s % (1 << level) == 0 and (s ^ (1 << level)) < self.slices)
                     for s in range(self.slices))

    def reduce(self, partials):
        """The tree's sum of `partials[0..slices-1]` (numpy arrays or floats), pair by pair in the order above: the
        reference for the bits a backend's reduction produces."""
        if len(partials) != self.slices:
            raise ExprError(f"{len(partials)} partials for a tree of {self.slices} slices")
        subtree = list(partials)          # subtree[b]: the sum of the subtree based at b, at the current level
        for level in range(self.levels):
            for base in range(0, self.slices, 2 << level):
                upper = base + (1 << level)
                if upper < self.slices:
                    subtree[base] = subtree[base] + subtree[upper]
        return subtree[0]


ROW, COL, FRAGMENT, SLAB, GROUP = Var("row"), Var("col"), Var("fragment"), Var("j"), Var("c")
SENDER, OWNER, THREAD = Var("sender"), Var("owner"), Var("ct")


@dataclass(frozen=True)
class ClusterReduce:
    """split-K reduce=cluster: the `slices` blocks of one output tile run as one thread-block cluster (sm90) and
    reduce through distributed shared memory instead of a workspace.

    Protocol (backends/cuda_ptx/sm90a.py renders it; l2ir.interp's `_split_k_owned` is its reference): block
    `slice` (its rank in the cluster) accumulates its slice's k tiles. Every block owns a share of the tile's
    elements (`owner`). Each block pushes every fragment unit it does not own into the owner's receive buffer
    (`receive_vec`; st.async into the other block's shared memory, each store counted by the owner's mbarrier in
    bytes), then waits until its own buffer holds all it owns from every other block (`receive_bytes`), adds the
    partials in slice order 0, 1, ..., slices - 1 (`reduce`; its own from registers) and stores its units to C. One
    cluster barrier, at entry, makes every block's receive mbarrier known before the first push; no block reads
    another's shared memory, so none waits for the others before it exits. No workspace, no counters, no atomics;
    the order of the sum is fixed, so C is bit-identical run to run.

    A fragment unit is one float4 of a consumer thread's wgmma accumulators: slab j (64 rows) and 8-column group c
    of its warpgroup's rows, `fragment` = j * BN/8 + c. In the tile's coordinates (`fragment_of`), row r and column
    col belong to unit ((r % WG_M) / 64) * (BN / 8) + col / 8 of the warpgroup that owns row r. Units go to the
    blocks round robin (`owner`), so every block stores an equal share when `slices` divides the units."""

    slices: int

    def __post_init__(self):
        if self.slices < 2:
            raise ExprError(f"cluster split-K of {self.slices} slice(s): a reduction needs at least 2")

    @property
    def owner(self) -> Expr:
        """The cluster rank (slice) that sums and stores fragment unit `fragment`."""
        return FRAGMENT % self.slices

    @staticmethod
    def unit(bn: int) -> Expr:
        """The fragment unit of a consumer thread's 64-row slab `j` and 8-column group `c` (the backend's loop
        variables), for a BN of `bn`."""
        return SLAB * (bn // 8) + GROUP

    @staticmethod
    def fragment_of(wg_m: int, bn: int) -> Expr:
        """The fragment unit of tile-local element (row, col), for warpgroups of `wg_m` rows: `unit` at slab
        (row % wg_m) / 64 and column group col / 8."""
        return (ROW % wg_m) // 64 * (bn // 8) + COL // 8

    @staticmethod
    def units(wg_m: int, bn: int) -> int:
        """Fragment units per consumer thread, for warpgroups of `wg_m` rows: 64-row slabs x 8-column groups."""
        return (wg_m // 64) * (bn // 8)

    def owned(self, units: int) -> Expr:
        """How many of a consumer thread's `units` fragment units block `slice` owns (round robin: the first
        units % slices ranks own one more)."""
        return (units + self.slices - 1 - SLICE) // self.slices

    def share(self, units: int) -> int:
        """The most units one block owns (rank 0's): a receive buffer's row of units per sending block."""
        return -(-units // self.slices)

    def receive_vec(self, units: int, threads: int) -> Expr:
        """The float4 of the receive buffer of block `owner` where block `sender` pushes fragment unit `fragment` of
        consumer thread `ct` (sender != owner): the senders fill rows 0 .. slices - 2 in rank order after the owner
        ((sender + slices - 1 - owner) % slices), a row holds the owner's units in order (fragment / slices, the
        rank of the unit among those it owns), a unit holds every consumer thread's float4 side by side (the
        pushes and the owner's reads are coalesced)."""
        row = (SENDER + self.slices - 1 - OWNER) % self.slices
        return (row * self.share(units) + FRAGMENT // self.slices) * threads + THREAD

    def receive_vecs(self, units: int, threads: int) -> int:
        """float4s of a receive buffer: slices - 1 rows of `share(units)` units of `threads` float4s."""
        return (self.slices - 1) * self.share(units) * threads

    def receive_bytes(self, units: int, threads: int) -> Expr:
        """Bytes block `slice` receives, what its mbarrier expects: every other block's float4 of each unit it owns,
        for each consumer thread."""
        return self.owned(units) * ((self.slices - 1) * threads * 16)

    @staticmethod
    def thread_of(wg_m: int) -> Expr:
        """The consumer thread (0 .. threads - 1) that holds tile element (row, col) in its accumulators: the wgmma
        m64nN f32 fragment, d[4c + 2h + e] at row 16 * warp + lane / 4 + 8h, column 8c + 2 * (lane % 4) + e of
        each 64-row slab, warpgroup row / wg_m."""
        return (ROW // wg_m) * 128 + (ROW % 64) // 16 * 32 + ROW % 8 * 4 + COL % 8 // 2

    @staticmethod
    def position_of() -> Expr:
        """Where element (row, col) sits in its fragment unit's float4: 2h + e of the fragment above."""
        return ROW % 16 // 8 * 2 + COL % 2

    def reduce(self, partials):
        """The sum the owners compute: partials[0] + partials[1] + ... in slice order (numpy arrays or floats)."""
        if len(partials) != self.slices:
            raise ExprError(f"{len(partials)} partials for a cluster of {self.slices} slices")
        total = partials[0]
        for p in partials[1:]:
            total = total + p
        return total


STEP, POSITION = Var("step"), Var("position")


@dataclass(frozen=True)
class BlockSplit:
    """split-K reduce=block: one block's two consumer warpgroups each take one slice of the tile's K loop
    (splitk_range with 2 slices: warpgroup `slice` owns k tiles [begin, end), slice 0 the longer range, by at most
    one tile), fed from one stage ring.

    The producer loads the slices' k tiles in turn: ring position p holds k tile `k_tile` (slice p % 2, its
    (p / 2)-th tile), for p = 0 .. k_tiles - 1. A consumer finds its `step`-th k tile at ring position `position`
    (stage = position % STAGES, phase = position / STAGES % 2); l2ir.interp checks every consumer's position
    against the tile the producer put there. Each warpgroup keeps only its own k tiles in flight, so both run the
    K loop at once on half of it, as two blocks of a split would, without a second block or a workspace. The ring
    has an even number of stages: position p's stage then always serves slice p % 2, so the warpgroup that waits
    on a stage's full barrier has waited on its previous phase itself. (With an odd ring the previous phase is the
    other warpgroup's; while its TMA load is still in flight, a parity wait for the phase after it passes at once.)

    After the loop the warpgroups add their partials through shared memory with ClusterReduce(2)'s fragment
    ownership: each stores the fragment units the other owns, and each sums and stores the units it owns (slice
    order 0 + 1; fp32 addition commutes, so C is bit-identical whichever warpgroup adds)."""

    SLICES = 2

    @classmethod
    def k_tile(cls) -> Expr:
        """The k tile the producer loads at ring position `position`."""
        begin, _ = splitk_range(cls.SLICES, POSITION % cls.SLICES)
        return begin + POSITION // cls.SLICES

    @classmethod
    def position(cls) -> Expr:
        """Ring position of slice `slice`'s `step`-th k tile. The slices alternate, and the shorter one (1) is
        at most one tile shorter, so it never runs out while slice 0 still has two tiles."""
        return STEP * cls.SLICES + SLICE


# Operands straight from global memory into mma.sync fragments (pipeline mode=direct).
U, Q, ELEM, STEP_I = Var("u"), Var("q"), Var("elem"), Var("i")


class DirectFeed:
    """pipeline mode=direct: each lane loads its m16n8k16 fragments from global memory itself, with no shared memory.

    Lane l is (g, q) = (l / 4, l % 4). At k step `step`, chunk `u` (k_offset), lane q loads one 16-byte vector of
    8 consecutive K elements, k = step*BK + 32u + 8q .. +7, from each row it feeds: A rows g and g + 8 of each m16
    block, B column g of each n8 block. So the four lanes of a row or column read 64 contiguous bytes, and one
    chunk covers 32 K. Halves 4h .. 4h+3 of the vector (words 2h, 2h+1) feed the chunk's k16 MMA h (two per
    chunk) at the fragment's K positions 2q, 2q+1, 2q+8, 2q+9: the MMA sums the same 16 products of the physical K
    elements 8q + 4h + 0..3 of every lane, in another order. A and B take their words by the same table, which
    is all that makes the sum A @ B (l2ir.interp evaluates the tables: it builds each MMA's logical fragments
    from them and checks that every (row, K position) and (K position, column) is fed exactly once).

    Rows whose start is not 16-byte aligned (pad.align < 8) load the two aligned vectors around the 8 elements
    and shift them out (realign_offset: elements from the lower aligned vector's start); the upper vector is
    loaded only when it holds an element of the row before `end` (realign_needs_upper)."""

    LANES_PER_ROW = 4          # lanes q = 0..3 of a group share one row of A / column of B
    ELEMS = 8                  # K elements per lane per chunk: one 16-byte vector
    CHUNK_K = LANES_PER_ROW * ELEMS     # 32: K per chunk
    MMAS_PER_CHUNK = 2         # k16 MMAs per chunk (h = 0, 1)
    # Fragment registers of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): each holds 2 adjacent halves.
    # A register r: row g + A_ROW[r], K positions 2q + A_KPOS[r] + {0, 1}; B register r: K positions 2q + B_KPOS[r]
    # + {0, 1}, column g; C element r: row g + C_ROW[r], column 2q + C_COL[r].
    A_ROW = (0, 8, 0, 8)
    A_KPOS = (0, 0, 8, 8)
    B_KPOS = (0, 8)
    C_ROW = (0, 0, 8, 8)
    C_COL = (0, 1, 0, 1)
    # The word (of the two a MMA takes from a lane's vector: 2h + WORD) each register is fed from.
    A_WORD = (0, 0, 1, 1)
    B_WORD = (0, 1)

    @classmethod
    def chunk_k(cls, bk: int) -> Expr:
        """First K element of lane q's vector in chunk u of k step `step`."""
        return STEP * bk + U * cls.CHUNK_K + Q * cls.ELEMS

    @classmethod
    def physical_k(cls, h: int, word: int) -> Expr:
        """K element, relative to the chunk's start, of the first half of `word` of MMA h, for lane q."""
        return Q * cls.ELEMS + (2 * h + word) * 2

    @staticmethod
    def slice_step(slices: int) -> Expr:
        """splitk reduce=block: the i-th k step of K slice `slice` (the block's warp group `slice`). Slices
        interleave, so the groups stream neighbouring parts of every row at once; slice 0 then adds the others'
        accumulators in slice order, so C is the same bits on every run."""
        return SLICE + STEP_I * slices

    @staticmethod
    def slice_steps(slices: int) -> Expr:
        """How many k steps (of `k_tiles`) slice `slice` takes: split-K gives every slice one at least."""
        return (K_TILES - SLICE + (slices - 1)) // slices

    @staticmethod
    def realign_offset() -> Expr:
        """pad.align < 8: elements between the aligned 16-byte vector below element address `elem` (in 2-byte
        units from a 16-byte aligned base) and the element."""
        return ELEM & 7

    @staticmethod
    def realign_needs_upper(offset: int, first: int, end: int) -> bool:
        """Whether the upper aligned vector holds an element wanted: the vector after the lower one starts at the
        element 8 - offset past `first`, which must lie before `end` (the row's end), and offset 0 needs none."""
        return offset > 0 and first + 8 - offset < end


# Columns in residue classes (the interleave node).
TILE_N, VIEW_ROW = Var("tile_n"), Var("j")


class Interleave:
    """The interleave node: each block takes BN columns of C that are STRIDE apart, all of one residue r = n mod
    STRIDE, so the K-major rows of B it reads all start at one offset inside a 16-byte vector.

    Column tile `tile_n` is residue r = tile_n % STRIDE and the (tile_n / STRIDE)-th run of BN rows of that residue's
    view: view row j is column n = STRIDE * j + r, and a residue has cdiv(N, STRIDE) view rows at most (those with
    n >= N are past N, as rows past N are in any tile). Consecutive tile_n are the STRIDE residues of one run, so
    blocks launched together cover STRIDE * BN consecutive columns and share the 16-byte vectors that straddle two
    rows of B in L2. Row n of B starts `offset` elements past a 16-byte boundary (from the operand's base in 2-byte
    units, `elem` = base + r * K); every row of the residue does (STRIDE * K elements apart is 16K bytes). The view
    reads each row from `offset` elements before its start, so its K index i is the row's k = i - offset, and it
    spans K + offset elements: cdiv(K + offset, BK) k-tiles (k_tiles), the first offset and everything past
    K + offset belonging to the neighbouring rows, which the kernel zeroes."""

    STRIDE = 8        # elements of one 16-byte vector

    @classmethod
    def tiles_n(cls, n, bn: int) -> Expr:
        """Column tiles over N columns: STRIDE residues, each cdiv(cdiv(N, STRIDE), BN) runs of BN view rows."""
        return cls.STRIDE * cdiv(cdiv(n, cls.STRIDE), bn)

    @classmethod
    def residue(cls) -> Expr:
        """The residue r of column tile `tile_n`."""
        return TILE_N % cls.STRIDE

    @classmethod
    def first_row(cls, bn: int) -> Expr:
        """The first view row of column tile `tile_n`."""
        return TILE_N // cls.STRIDE * bn

    @classmethod
    def column(cls) -> Expr:
        """The column of C (row of the K-major B) of view row `j` of residue `r`."""
        return VIEW_ROW * cls.STRIDE + Var("r")

    @staticmethod
    def offset() -> Expr:
        """Elements between the 16-byte boundary below element address `elem` and the element."""
        return ELEM & 7

    @staticmethod
    def k_tiles(k, offset, bk: int) -> Expr:
        """k-tiles of a residue's view: its K + offset elements in tiles of BK."""
        return cdiv(lift(k) + offset, bk)

    # The tensor-map form (sm90a, pipeline mode=tma_ws). B's view is one 2D tensor map of pitch STRIDE * K over the
    # view rows, read from the same `offset` before each row as the cp.async form (a TMA box must start on a
    # 16-byte boundary: an element start is an illegal instruction); A's stages are loads shifted to meet it.
    # The map covers only the view rows all of whose STRIDE residues exist (tma_view_rows), so no box reads past
    # B; the N mod STRIDE columns after them, the tail, are dot products of the consumer warps (tail_row,
    # tail_column).
    TAIL = Var("o")     # one output of the tail, 0 .. M * (N mod STRIDE) - 1

    @classmethod
    def tma_view_rows(cls, n) -> Expr:
        """View rows of the tensor-map form's B map: floor(N / STRIDE). A tile stores only its view rows below it."""
        return lift(n) // cls.STRIDE

    @classmethod
    def tail_columns(cls, n) -> Expr:
        """Columns of C past the tensor-map form's view, N mod STRIDE: C's last columns, computed by the tail."""
        return lift(n) % cls.STRIDE

    @classmethod
    def tail_row(cls, n) -> Expr:
        """The row of C of tail output `o` (outputs run along the tail's columns, then down the rows)."""
        return cls.TAIL // cls.tail_columns(n)

    @classmethod
    def tail_column(cls, n) -> Expr:
        """The column of C of tail output `o`."""
        return cls.STRIDE * cls.tma_view_rows(n) + cls.TAIL % cls.tail_columns(n)


def column_tiles(n, bn: int, interleave: bool) -> Expr:
    """Output tiles along N: runs of BN consecutive columns, or with the interleave node STRIDE residues of runs of
    BN view rows (Interleave.tiles_n)."""
    return Interleave.tiles_n(n, bn) if interleave else cdiv(n, bn)


# Operand repacking (the repack node).
M, N, K = Var("m"), Var("n"), Var("k")
COLS, CHUNK = Var("cols"), Var("chunk")
REPACK_ALIGN = 8          # elements: 16 bytes of f16/bf16, what TMA strides and 16-byte cp.async need
REPACK_COPY_ALIGN = 64    # elements: each copy, and what follows it, starts 128-byte aligned


@dataclass(frozen=True)
class Repack:
    """The repack node's copies: where each operand goes in the workspace and where each element goes in its copy.

    An operand is stored as `rows` x `cols` with `cols` contiguous (`extent`: A row-major is M x K, B column-major
    N x K). When `cols` is not a multiple of REPACK_ALIGN (`needed` = 1) and the operand is in `operands`, the repack
    kernel copies it to rows of `pitch` elements, one REPACK_ALIGN-element chunk (a 16-byte store) at a time: chunk
    `chunk` of the copy is row `chunk_row`, columns `chunk_col` onwards, stored at `dst` of its first element, with
    zeros in the pad columns [cols, pitch), so every element of the copy is written once. The GEMM reads the copy
    with the same extents and a `pitch` stride. An aligned operand is not copied and takes no workspace
    (`copy_elems` = 0).

    Workspace, in elements of the input dtype: B's copy at 0, A's at `offset("A")` = B's copy size, each copy rounded
    up to REPACK_COPY_ALIGN elements; whatever else the kernel keeps in the workspace (split-K) starts at `end`. B
    comes first because it is usually a layer's fixed weights: its copy keeps one address whatever M is, so the host
    shim's cached tensor map of it stays valid while the activations change.
    backends/cuda_ptx/sm90a.py renders these expressions into the host shim and the repack kernel; l2ir.interp runs
    the same copy and reads the operands back through it."""

    operands: str = "ab"                # the node's field: which operands may be copied
    a_layout: str = "row"               # the problem's layouts
    b_layout: str = "col"

    @staticmethod
    def pitch(cols) -> Expr:
        """Elements per row of a copy: cols rounded up to REPACK_ALIGN."""
        return cdiv(cols, REPACK_ALIGN) * REPACK_ALIGN

    @staticmethod
    def needed(cols) -> Expr:
        """1 when rows of `cols` elements are not REPACK_ALIGN-aligned (the operand must be copied), else 0."""
        return cdiv(lift(cols) % REPACK_ALIGN, REPACK_ALIGN)   # no min(): C++ has no min(long long, int)

    @staticmethod
    def dst() -> Expr:
        """Offset in the copy of element (row, col) of an operand with `cols` contiguous columns."""
        return ROW * Repack.pitch(COLS) + COL

    @staticmethod
    def src() -> Expr:
        """Offset of element (row, col) in the operand itself."""
        return ROW * COLS + COL

    @staticmethod
    def chunk_row() -> Expr:
        """The copy's row of chunk `chunk` (REPACK_ALIGN elements, one 16-byte store)."""
        return CHUNK // (Repack.pitch(COLS) // REPACK_ALIGN)

    @staticmethod
    def chunk_col() -> Expr:
        """The first column of chunk `chunk`; the chunk's elements are that column and the next REPACK_ALIGN - 1,
        stored at `dst` of the first and the following addresses."""
        return CHUNK % (Repack.pitch(COLS) // REPACK_ALIGN) * REPACK_ALIGN

    @staticmethod
    def chunks(rows, cols) -> Expr:
        """Chunks of a copy of `rows` rows of `cols` elements."""
        return lift(rows) * (Repack.pitch(cols) // REPACK_ALIGN)

    def extent(self, operand: str) -> tuple[Expr, Expr]:
        """(rows, cols) of operand "A" or "B" as stored, cols contiguous."""
        logical, layout = {"A": ((M, K), self.a_layout), "B": ((K, N), self.b_layout)}[operand]
        return logical if layout == "row" else (logical[1], logical[0])

    def copy_elems(self, operand: str) -> Expr:
        """Workspace elements of the operand's copy: 0 when it is not in `operands` or already aligned."""
        if operand.lower() not in self.operands:
            return Const(0)
        rows, cols = self.extent(operand)
        return self.needed(cols) * cdiv(rows * self.pitch(cols), REPACK_COPY_ALIGN) * REPACK_COPY_ALIGN

    def offset(self, operand: str) -> Expr:
        """Element offset of the operand's copy in the workspace: B's first, then A's."""
        return Const(0) if operand.upper() == "B" else self.copy_elems("B")

    @property
    def end(self) -> Expr:
        """Elements taken by both copies: the split-K workspace starts here."""
        return self.copy_elems("B") + self.copy_elems("A")


# ---------------------------------------------------------------------------------------------------------------
# Launch-geometry expressions of m, n, k (Source kernels, launch plans).
# ---------------------------------------------------------------------------------------------------------------

LAUNCH_VARS = frozenset({"m", "n", "k"})


def parse_expr(text: str) -> Expr:
    """Parse an index expression such as 'cdiv(n, 128) * 2'. Raises ParseError with the column on bad input."""
    from .text import parse_expr as _parse  # the one grammar lives in text.py

    return _parse(text)


def eval_launch_expr(expr: Expr | str, m: int, n: int, k: int) -> int:
    """Evaluate a launch-geometry expression for one problem size."""
    e = parse_expr(expr) if isinstance(expr, str) else expr
    extra = e.free_vars() - LAUNCH_VARS
    if extra:
        raise ExprError(f"launch expression '{e}' uses {', '.join(sorted(extra))}; only m, n, k are bound")
    return int(e.eval({"m": m, "n": n, "k": k}))
