"""The reference interpreter: runs a kernel's schedule at tile granularity on numpy arrays.

It follows the schedule, not just the math: blocks in rasterized launch order (the same index expressions the
backends render to C++), the K loop through a ring of `stages` shared-memory slots stored through the swizzle
permutation, each dimension's padding mode (zero-filled loads, or predicated loads that leave poison in shared
memory and are masked out of the MMA and the store), accumulation in the accumulator dtype at the MMA's K step,
split-K partials through a workspace and their pairwise-tree reduction (l2ir.indexing.SplitKTree) or through a
cluster's shared memory, each block storing its share (l2ir.indexing.ClusterReduce), or through one block's shared
memory from two consumer warpgroups fed by one ring (l2ir.indexing.BlockSplit), stream-K segments and their
fix-up, a cluster's TMA multicast (each block's stages assembled from the shares its cluster's blocks load,
l2ir.indexing.ClusterMulticast), the interleave node's columns 8 apart and its views of A and B shifted to where
B's rows start (l2ir.indexing.Interleave), and an epilogue that rounds to the output dtype and stores in vectors. It counts every write of C
and of the workspace and raises InterpError unless each element of C is written exactly once and each workspace slot
as often as the split-K tree says.

For fp32 accumulation one k tile is one float32 matmul (fp16 x fp16 products are exact in fp32, so only the
summation order differs from the MMA's). For fp16 accumulation every MMA instruction rounds its sum to fp16, as the
hardware does, which is what makes fp16 accumulation measurably worse at large K.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .errors import InterpError
from .indexing import (REPACK_ALIGN, BlockSplit, ClusterMulticast, ClusterReduce, DirectFeed, Interleave, Repack,
                       SplitKTree, ceil_div, column_tiles, rasterize, smem_swizzle, splitk_range, tma_store_box_cols,
                       tma_store_origin, tma_store_staging)
from .nodes import Kernel, Problem
from .analysis import block_reduce, multicast, direct_half_fed, direct_shape, direct_slices, resolved_stages, shares_fragments, warpgroups_m
from .target import H200_SMS, UNIT_ROUNDOFF
from .verify import check_problem

NP_DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}
# Unit roundoff of each dtype (half an ulp at 1.0).
DEFAULT_WORKERS = H200_SMS   # SMs of an H100/H200: the persistent grid of a stream-K launch


def tma_swizzle_128b_read(box: int, wg_m: int, box_cols: int) -> np.ndarray:
    """Element indices, in a warpgroup's staging buffer, that a TMA load or store with CU_TENSOR_MAP_SWIZZLE_128B
    reads for box `box` (wg_m rows x box_cols 2-byte columns, box_cols * 2 = 128 bytes, base 1024-byte aligned): the
    hardware's rule on the byte address, 16-byte chunk c of row r at chunk c ^ (r % 8) (CUDA programming guide, TMA
    swizzle modes), stated here apart from l2ir.indexing.tma_store_staging so that the two must agree."""
    r, c = np.meshgrid(np.arange(wg_m), np.arange(box_cols), indexing="ij")
    byte = box * wg_m * 128 + r * 128 + (((2 * c) // 16) ^ (r % 8)) * 16 + (2 * c) % 16
    return byte // 2


@dataclass
class InterpResult:
    c: np.ndarray                          # M x N in the output dtype
    order: list[tuple[int, int]]           # output tiles in launch order (first visit)
    c_writes: np.ndarray                   # times each element of C was written (all ones when correct)
    workspace_writes: np.ndarray | None = None
    k_ranges: dict = field(default_factory=dict)   # (tile_m, tile_n) -> the k-tile ranges accumulated into it
    repack_writes: np.ndarray | None = None        # writes of each workspace element by the repack kernel


def random_inputs(problem: Problem, rng: np.random.Generator, integers: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Logical A (MxK) and B (KxN) in the problem's input dtype: randn, or small integers (exact in every dtype)."""
    dt = NP_DTYPES[problem.a[0]]
    if integers:
        a = rng.integers(-2, 3, size=(problem.m, problem.k)).astype(dt)
        b = rng.integers(-2, 3, size=(problem.k, problem.n)).astype(dt)
    else:
        a = rng.standard_normal((problem.m, problem.k)).astype(dt)
        b = rng.standard_normal((problem.k, problem.n)).astype(dt)
    return a, b


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ b.astype(np.float64)


def error_bound(problem: Problem, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise bound on |C - A@B| for a correct kernel: the accumulator's K-term rounding bound
    gamma_K * (|A| @ |B|) plus one rounding to the output dtype, plus half the smallest subnormal step."""
    u_acc = UNIT_ROUNDOFF[problem.acc]
    u_out = UNIT_ROUNDOFF[problem.c[0]]
    k = problem.k
    gamma = np.expm1(k * np.log1p(u_acc))   # (1+u)^K - 1: valid for every K, even where K*u >= 1 (fp16 acc)
    mag = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    ref = reference(a, b)
    return u_out * np.abs(ref) + (1 + u_out) * gamma * mag + 2.0 ** -24


class _Ring:
    """A shared-memory ring of `stages` slots, each a flat tile stored through the swizzle permutation."""

    def __init__(self, stages: int, rows: int, cols: int, perm: np.ndarray, dtype, poison):
        self.rows, self.cols, self.perm = rows, cols, perm
        self.slots = np.full((stages, rows * cols), poison, dtype=dtype)

    def store(self, slot: int, tile: np.ndarray) -> None:
        self.slots[slot][self.perm] = tile.ravel()

    def load(self, slot: int) -> np.ndarray:
        return self.slots[slot][self.perm].reshape(self.rows, self.cols)


def _swizzle_perm(kernel: Kernel, size: int) -> np.ndarray:
    """Where each element of a row-major (rows x BK) tile lives in shared memory."""
    offsets = np.arange(size, dtype=np.int64)
    if kernel.swizzle is None or kernel.swizzle.smem is None:
        return offsets
    perm = smem_swizzle(*kernel.swizzle.smem).eval({"offset": offsets})
    if perm.min() < 0 or perm.max() >= size or len(np.unique(perm)) != size:
        raise InterpError(f"swizzle {kernel.swizzle.smem} does not permute a {size}-element tile")
    return perm


class _Schedule:
    """One kernel run on one problem."""

    def __init__(self, kernel: Kernel, problem: Problem, a: np.ndarray, b: np.ndarray):
        self.kernel, self.problem = kernel, problem
        self.a, self.b = a, b
        self.bm, self.bn, self.bk = kernel.tile.block
        self.tiles_m = ceil_div(problem.m, self.bm)
        self.interleave = kernel.interleave is not None
        # The interleave node's tensor-map form (tma_ws): B's view through TMA over Interleave.tma_view_rows view
        # rows (A's stages written by threads); the columns after them are the tail.
        self.tma_view = self.interleave and kernel.pipeline.mode == "tma_ws"
        self.tiles_n = int(column_tiles(problem.n, self.bn, self.interleave).eval({}))
        self._column_cache: dict[int, tuple[np.ndarray, int]] = {}
        self.k_tiles = ceil_div(problem.k, self.bk)
        self.in_dtype = NP_DTYPES[problem.a[0]]
        self.acc_dtype = NP_DTYPES[problem.acc]
        self.out_dtype = NP_DTYPES[problem.c[0]]
        self.stages = resolved_stages(kernel)
        self.mma_k = kernel.mma.shape[2]
        pad = kernel.pad
        # predicate: nothing is loaded out of range, so the slot keeps whatever was there: model it as NaN poison,
        # which the masked MMA and store must never let through. zero_fill: the copy engine writes zeros.
        self.poison = {d: (np.nan if getattr(pad, d) == "predicate" else 0.0) for d in "mnk"}
        self.perm_a = _swizzle_perm(kernel, self.bm * self.bk)
        self.perm_b = _swizzle_perm(kernel, self.bn * self.bk)

    # ---- the interleave node (l2ir.indexing.Interleave) -------------------------------------------------------
    def tile_cols(self, tn: int) -> np.ndarray:
        """The column of C of each of column tile tn's BN columns (past N for a tile that overhangs it)."""
        return self._columns(tn)[0]

    def view_offset(self, tn: int) -> int:
        """interleave: elements between the 16-byte boundary below the first row of column tile tn's residue and
        that row (the model's operands start 16-byte aligned); 0 without the node."""
        return self._columns(tn)[1]

    def _columns(self, tn: int) -> tuple[np.ndarray, int]:
        """(tile_cols, view_offset) of column tile tn, evaluated and checked once per run: every k tile's load and
        the store ask for them."""
        if tn not in self._column_cache:
            self._column_cache[tn] = self._evaluate_columns(tn)
        return self._column_cache[tn]

    def _evaluate_columns(self, tn: int) -> tuple[np.ndarray, int]:
        if not self.interleave:
            return tn * self.bn + np.arange(self.bn), 0
        env = {"tile_n": tn}
        r = int(Interleave.residue().eval(env))
        j = int(Interleave.first_row(self.bn).eval(env)) + np.arange(self.bn)
        cols = np.asarray(Interleave.column().eval({"j": j, "r": r}))
        off = int(Interleave.offset().eval({"elem": r * self.problem.k}))
        # The view is read in whole 16-byte vectors: every row of the residue must start `off` elements past one.
        starts = (cols * self.problem.k - off) % Interleave.STRIDE
        if off > r * self.problem.k or starts.any():
            raise InterpError(f"interleave: column tile {tn}'s view starts {off} elements before its rows, which "
                              "leaves them off a 16-byte boundary")
        return cols, off

    def tile_stores(self, tn: int) -> np.ndarray:
        """Which of column tile tn's BN columns its block stores: those inside C, and in the tensor-map form only
        those of the view rows the B map covers (the tail's columns are loaded as zeros and stored by the tail)."""
        cols = self.tile_cols(tn)
        ok = cols < self.problem.n
        if self.tma_view:
            ok &= cols // Interleave.STRIDE < int(Interleave.tma_view_rows(self.problem.n).eval({}))
        return ok

    def tail(self, c: np.ndarray, writes: np.ndarray) -> None:
        """The tensor-map form's tail: C's last N mod 8 columns, each output one fp32 dot product of a row of A and
        a row of the K-major B (l2ir.indexing.Interleave.tail_row / tail_column), rounded once. Every output must
        land inside the tail's columns, once."""
        p = self.problem
        t = int(Interleave.tail_columns(p.n).eval({}))
        if not t:
            return
        o = np.arange(p.m * t, dtype=np.int64)
        rows = np.broadcast_to(Interleave.tail_row(p.n).eval({"o": o}), o.shape)
        cols = np.broadcast_to(Interleave.tail_column(p.n).eval({"o": o}), o.shape)
        first = Interleave.STRIDE * int(Interleave.tma_view_rows(p.n).eval({}))
        if rows.min() < 0 or rows.max() >= p.m or cols.min() < first or cols.max() >= p.n:
            raise InterpError(f"interleave tail: outputs land outside rows [0, {p.m}) x columns [{first}, {p.n})")
        dots = np.einsum("ik,ik->i", self.a[rows].astype(np.float32), self.b.T[cols].astype(np.float32))
        c[rows, cols] = dots.astype(self.out_dtype)
        np.add.at(writes, (rows, cols), 1)

    def tile_k_tiles(self, tn: int) -> int:
        """k tiles of column tile tn: interleave runs them over B's view, K + offset elements."""
        if not self.interleave:
            return self.k_tiles
        return int(Interleave.k_tiles(self.problem.k, self.view_offset(tn), self.bk).eval({}))

    def _view(self, src: np.ndarray, rows: np.ndarray, row_dim: str, kt: int, off: int) -> np.ndarray:
        """interleave: rows `rows` of the K-major operand src at k tile kt of the view that starts `off` elements
        before each row. Elements outside the row (k < 0 or k >= K: the neighbouring rows' or past the matrix) are
        zeros, as the kernel zeroes them in both operands; rows past the operand take their dimension's padding."""
        ks = kt * self.bk + np.arange(self.bk) - off
        out = np.zeros((len(rows), self.bk), dtype=self.in_dtype)
        rok, kok = rows < src.shape[0], (ks >= 0) & (ks < src.shape[1])
        out[~rok, :] = self.poison[row_dim]
        out[np.ix_(rok, kok)] = src[np.ix_(rows[rok], ks[kok])]
        return out

    # ---- operand tiles --------------------------------------------------------------------------------------
    def _tile(self, src: np.ndarray, r0: int, rows: int, c0: int, cols: int, row_dim: str, col_dim: str):
        """Copy a rows x cols box of src; the part outside src gets the padding value of its dimension."""
        out = np.empty((rows, cols), dtype=self.in_dtype)
        vr = max(0, min(rows, src.shape[0] - r0))
        vc = max(0, min(cols, src.shape[1] - c0))
        out[vr:, :] = self.poison[row_dim]
        out[:vr, vc:] = self.poison[col_dim]
        out[:vr, :vc] = src[r0:r0 + vr, c0:c0 + vc]
        return out

    # ---- the main loop of one block -------------------------------------------------------------------------
    def mainloop(self, tm: int, tn: int, kb: int, ke: int, feed=None) -> np.ndarray:
        """Accumulate k tiles [kb, ke) of output tile (tm, tn) through the stage ring. `feed(kt)`, if given, is
        what lands in the block's stage for k tile kt (a cluster's multicast), instead of its own two boxes."""
        ring_a = _Ring(self.stages, self.bm, self.bk, self.perm_a, self.in_dtype, np.nan)
        ring_b = _Ring(self.stages, self.bn, self.bk, self.perm_b, self.in_dtype, np.nan)
        acc = np.zeros((self.bm, self.bn), dtype=self.acc_dtype)
        stages, n = self.stages, ke - kb

        def produce(i: int) -> None:
            """The copy of k tile kb+i into its ring slot."""
            if feed is None:
                self._load(ring_a, ring_b, i % stages, tm, tn, kb + i)
            else:
                a_t, b_t = feed(kb + i)
                ring_a.store(i % stages, a_t)
                ring_b.store(i % stages, b_t)

        # The producer runs stages-1 tiles ahead: the prologue fills all but one slot, and each iteration refills
        # the slot consumed one iteration earlier before it consumes its own. A wrong slot mapping therefore
        # consumes the wrong tile (or poison) and shows in the result.
        ahead = max(stages - 1, 0)
        for i in range(min(ahead, n)):
            produce(i)
        for i in range(n):
            kt = kb + i
            if i + ahead < n and ahead:
                produce(i + ahead)
            elif not ahead:
                produce(i)          # one stage: load, wait, compute
            acc = self._accumulate(acc, ring_a, ring_b, i % stages, kt)
        return acc

    def _load(self, ring_a: _Ring, ring_b: _Ring, slot: int, tm: int, tn: int, kt: int) -> None:
        """The copy of k tile kt of output tile (tm, tn)'s A rows and B columns into ring slot `slot` (interleave:
        of B's view of the tile's columns and of A's rows shifted to meet it)."""
        if self.interleave:
            # Both forms read the same view (a TMA box starts on a 16-byte boundary as a cp.async vector does).
            off = self.view_offset(tn)
            b_t = self._view(self.b.T, self.tile_cols(tn), "n", kt, off)
            if self.tma_view:
                # B's view rows past the map's (Interleave.tma_view_rows) are its out-of-bounds fill: zeros.
                b_t[~self.tile_stores(tn)] = 0
            ring_a.store(slot, self._view(self.a, tm * self.bm + np.arange(self.bm), "m", kt, off))
            ring_b.store(slot, b_t)
            return
        ring_a.store(slot, self._tile(self.a, tm * self.bm, self.bm, kt * self.bk, self.bk, "m", "k"))
        ring_b.store(slot, self._tile(self.b.T, tn * self.bn, self.bn, kt * self.bk, self.bk, "n", "k"))

    def _accumulate(self, acc: np.ndarray, ring_a: _Ring, ring_b: _Ring, slot: int, kt: int) -> np.ndarray:
        """acc += the MMAs over ring slot `slot`, which holds k tile kt."""
        a_t = ring_a.load(slot).astype(np.float32)
        b_t = ring_b.load(slot).astype(np.float32)
        # (interleave: the view's elements outside the rows are zeros already, and it runs K + offset long.)
        valid_k = (min(self.bk, self.problem.k - kt * self.bk)
                   if self.kernel.pad.k == "predicate" and not self.interleave else self.bk)
        # Rows of A past M and columns of B past N may hold poison under predicate padding: they only reach
        # accumulator rows/columns that the store masks. K columns past K are masked here, as the residue
        # iteration of a predicated main loop does.
        if self.acc_dtype == np.float32:
            acc += a_t[:, :valid_k] @ b_t[:, :valid_k].T
        else:
            for kk in range(0, valid_k, self.mma_k):
                kw = min(kk + self.mma_k, valid_k)
                prod = a_t[:, kk:kw] @ b_t[:, kk:kw].T
                acc = (acc.astype(np.float32) + prod).astype(self.acc_dtype)
        return acc

    def _block_split_partials(self, tm: int, tn: int, k_cover: dict) -> list[np.ndarray]:
        """reduce=block (l2ir.indexing.BlockSplit), run as the protocol runs: the producer fills ring position p with
        k tile BlockSplit.k_tile once the position `stages` back has been released; consumer warpgroup `slice` reads
        its `step`-th tile of its splitk_range at ring position BlockSplit.position once it has landed, and releases
        its previous position only then (it keeps one k tile's MMAs in flight), its last one when it is done. Every
        slot remembers the k tile the producer put there: a consumer that finds another tile than its range says
        raises, and so does a ring on which neither the producer nor a consumer can move (too few stages for the
        release-after-next protocol), and a consumer whose stage's previous phase was the other one's (an odd ring:
        a parity wait cannot tell those phases apart). Returns the two fp32 partials."""
        stages, slices, env = self.stages, BlockSplit.SLICES, {"k_tiles": self.k_tiles}
        begin, end = splitk_range(slices)
        ranges = [(int(begin.eval({**env, "slice": s})), int(end.eval({**env, "slice": s}))) for s in range(slices)]
        loads = [int(BlockSplit.k_tile().eval({**env, "position": p})) for p in range(self.k_tiles)]
        position = BlockSplit.position()
        plans = [[int(position.eval({**env, "step": j, "slice": s})) for j in range(ke - kb)]
                 for s, (kb, ke) in enumerate(ranges)]
        if sorted(p for plan in plans for p in plan) != list(range(self.k_tiles)):
            raise InterpError(f"tile ({tm}, {tn}): the consumers' ring positions {plans} are not the producer's "
                              f"{self.k_tiles} loads, each once")
        ring_a = _Ring(stages, self.bm, self.bk, self.perm_a, self.in_dtype, np.nan)
        ring_b = _Ring(stages, self.bn, self.bk, self.perm_b, self.in_dtype, np.nan)
        tags = [-1] * stages
        accs = [np.zeros((self.bm, self.bn), dtype=self.acc_dtype) for _ in range(slices)]
        released: set[int] = set()
        produced, steps = 0, [0] * slices
        while any(steps[s] < len(plans[s]) for s in range(slices)):
            moved = False
            while produced < self.k_tiles and (produced < stages or produced - stages in released):
                self._load(ring_a, ring_b, produced % stages, tm, tn, loads[produced])
                tags[produced % stages] = loads[produced]
                produced, moved = produced + 1, True
            for s in range(slices):
                j = steps[s]
                if j == len(plans[s]) or plans[s][j] >= produced:
                    continue
                pos, kt = plans[s][j], ranges[s][0] + j
                if pos >= stages and pos - stages not in plans[s][:j]:
                    # A parity wait tells a phase only from the one before it: the waiter must have seen that
                    # one complete itself, or a load still in flight for it lets the wait pass at once.
                    raise InterpError(f"tile ({tm}, {tn}): consumer warpgroup {s} waits on ring slot {pos % stages} "
                                      f"for position {pos}, whose previous phase (position {pos - stages}) another "
                                      "warpgroup consumes: an mbarrier parity wait cannot tell the two phases apart")
                if tags[pos % stages] != kt:
                    raise InterpError(f"tile ({tm}, {tn}): consumer warpgroup {s} expected k tile {kt} in ring slot "
                                      f"{pos % stages}, which holds k tile {tags[pos % stages]}")
                accs[s] = self._accumulate(accs[s], ring_a, ring_b, pos % stages, kt)
                if j > 0:
                    released.add(plans[s][j - 1])      # the previous tile's MMAs are done once this one is issued
                steps[s], moved = j + 1, True
                if steps[s] == len(plans[s]):
                    released.add(pos)                  # the last one after the loop's final wait
            if not moved:
                raise InterpError(f"tile ({tm}, {tn}): the ring of {stages} stages deadlocks: the producer waits for "
                                  f"position {produced - stages} to be released, and its consumer for position "
                                  f"{produced}")
        for kb, ke in ranges:
            if ke > kb:
                k_cover.setdefault((tm, tn), []).append((kb, ke))
        return [acc.astype(np.float32) for acc in accs]

    # ---- epilogue -------------------------------------------------------------------------------------------
    def store(self, c: np.ndarray, writes: np.ndarray, tm: int, tn: int, tile: np.ndarray,
              mask: np.ndarray | None = None) -> None:
        """Round to the output dtype and store the in-range part in vectors of epilogue.vector elements; with a
        `mask` (BM x BN), only the tile elements it selects (one block's share of a cluster-reduced tile)."""
        out = tile.astype(np.float32).astype(self.out_dtype)   # (the smem path only reorders the same stores)
        elem = np.dtype(self.out_dtype).itemsize
        box_cols = tma_store_box_cols(elem)
        if self.kernel.epilogue.path == "tma" and mask is None and elem == 2 and self.bn % box_cols == 0:
            self._store_boxes(c, writes, tm, tn, out, box_cols)
            return
        r0, c0 = tm * self.bm, tn * self.bn
        vr = min(self.bm, self.problem.m - r0)
        vec = self.kernel.epilogue.vector
        if self.interleave:
            # One element per store (the verifier's vector=1): a thread's two columns are 8 apart.
            cols = self.tile_cols(tn)
            sel = np.zeros((self.bm, self.bn), dtype=bool)
            sel[:vr] = self.tile_stores(tn)[None, :]
            if mask is not None:
                sel &= mask
            rr, jj = np.nonzero(sel)
            c[r0 + rr, cols[jj]] = out[rr, jj]
            np.add.at(writes, (r0 + rr, cols[jj]), 1)
            return
        vc = min(self.bn, self.problem.n - c0)
        for j in range(0, vc, vec):
            if j + vec > vc:
                raise InterpError(f"a {vec}-element vector store at column {c0 + j} crosses N={self.problem.n}")
            if mask is None:
                c[r0:r0 + vr, c0 + j:c0 + j + vec] = out[:vr, j:j + vec]
                writes[r0:r0 + vr, c0 + j:c0 + j + vec] += 1
                continue
            sel = mask[:vr, j:j + vec]
            dst = c[r0:r0 + vr, c0 + j:c0 + j + vec]
            dst[sel] = out[:vr, j:j + vec][sel]
            writes[r0:r0 + vr, c0 + j:c0 + j + vec] += sel

    @functools.cached_property
    def _tma_store_layout(self) -> tuple[int, np.ndarray, list[np.ndarray]]:
        """epilogue.path=tma (2-byte C): (WG_M, the staging offset of each element of a warpgroup's WG_M x BN block,
        the staging elements TMA reads for each box). The same for every tile: checked once, when first stored."""
        box_cols = tma_store_box_cols(np.dtype(self.out_dtype).itemsize)
        wg_m = self.bm // warpgroups_m(self.kernel)
        r, col = np.meshgrid(np.arange(wg_m), np.arange(self.bn), indexing="ij")
        offsets = np.broadcast_to(tma_store_staging(wg_m, box_cols).eval({"r": r, "col": col}), r.shape)
        slots = np.bincount(offsets.ravel(), minlength=wg_m * self.bn)
        if offsets.min() < 0 or len(slots) != wg_m * self.bn or (slots != 1).any():
            raise InterpError(f"epilogue.path=tma: the staging layout of a {wg_m}x{self.bn} block does not fill its "
                              "buffer exactly once")
        return wg_m, offsets, [tma_swizzle_128b_read(box, wg_m, box_cols) for box in range(self.bn // box_cols)]

    def _store_boxes(self, c: np.ndarray, writes: np.ndarray, tm: int, tn: int, out: np.ndarray,
                     box_cols: int) -> None:
        """epilogue.path=tma (2-byte C): each consumer warpgroup stages its WG_M x BN block through the swizzled box
        layout (l2ir.indexing.tma_store_staging), which must fill its buffer exactly once; then TMA reads each box as
        the hardware does (tma_swizzle_128b_read, written independently of the staging formula, so a staging layout
        that is a bijection but not TMA's swizzle gives a wrong C) and stores it at its origin (tma_store_origin),
        clipped at M and N."""
        wg_m, offsets, reads = self._tma_store_layout
        row0, col0 = tma_store_origin(self.bm, self.bn, wg_m, box_cols)
        for cw in range(self.bm // wg_m):
            buf = np.empty(wg_m * self.bn, dtype=out.dtype)
            buf[offsets] = out[cw * wg_m:(cw + 1) * wg_m]
            for box, read in enumerate(reads):
                env = {"tile_m": tm, "tile_n": tn, "cw": cw, "box": box}
                gr, gc = int(row0.eval(env)), int(col0.eval(env))
                rows, cols = min(wg_m, self.problem.m - gr), min(box_cols, self.problem.n - gc)
                if rows <= 0 or cols <= 0:
                    continue                       # a box wholly outside C: TMA writes nothing
                c[gr:gr + rows, gc:gc + cols] = buf[read][:rows, :cols]
                writes[gr:gr + rows, gc:gc + cols] += 1

    # ---- the launch -----------------------------------------------------------------------------------------
    def tile_order(self) -> list[tuple[int, int]]:
        """Each block's output tile in launch order. With a multicast cluster the grid is whole clusters, so blocks
        past the tile grid (tiles_m or tiles_n not a multiple of the cluster's) are in it too."""
        sw = self.kernel.swizzle
        order, group = (sw.raster, sw.group) if sw is not None else ("along_n", 1)
        mc = multicast(self.kernel)
        if mc is None:
            em, en = rasterize(order, group)
            blocks = self.tiles_m * self.tiles_n
        else:
            em, en = mc.tile(order, group)
            blocks = mc.size * int(mc.clusters().eval({"tiles_m": self.tiles_m, "tiles_n": self.tiles_n}))
        pid = np.arange(blocks, dtype=np.int64)
        env = {"pid": pid, "tiles_m": self.tiles_m, "tiles_n": self.tiles_n}
        tm, tn = np.broadcast_to(em.eval(env), pid.shape), np.broadcast_to(en.eval(env), pid.shape)
        return list(zip(tm.tolist(), tn.tolist()))

    def run(self, workers: int) -> InterpResult:
        p = self.problem
        repack_writes = None
        if self.kernel.repack is not None:
            self.a, self.b, repack_writes = _repack(self.kernel, p, self.a, self.b)
        c = np.full((p.m, p.n), np.nan, dtype=self.out_dtype)
        writes = np.zeros((p.m, p.n), dtype=np.int32)
        order = self.tile_order()
        mc = multicast(self.kernel)
        for tm, tn in order:
            if mc is not None and tm >= 0 and tn >= 0:
                continue        # a cluster's block past the grid loads for the others and stores nothing
            if not (0 <= tm < self.tiles_m and 0 <= tn < self.tiles_n):
                raise InterpError(f"rasterization sent a block to tile ({tm}, {tn}) outside the "
                                  f"{self.tiles_m}x{self.tiles_n} grid")
        sk = self.kernel.splitk
        if self.interleave and (mc is not None or self.kernel.pipeline.mode == "direct"
                                or (sk is not None and (sk.mode != "split_k" or shares_fragments(self.kernel)))):
            raise InterpError("interleave is modelled on one-tile-per-block schedules, with split_k through the "
                              "workspace tree or no split")
        ws_writes = None
        k_cover: dict = {}
        if self.kernel.pipeline.mode == "direct":
            self._direct(c, writes, order)
            k_cover = {t: [(0, self.k_tiles)] for t in order}
        elif mc is not None and sk is not None:
            ws_writes, ws_expected = self._split_k(c, writes, order, sk.slices, k_cover,
                                                   partial=self._multicast_partials(order, mc, sk.slices, k_cover))
        elif mc is not None:
            self._multicast(c, writes, order, mc, k_cover)
        elif sk is None:
            for tm, tn in order:
                self.store(c, writes, tm, tn, self.mainloop(tm, tn, 0, self.tile_k_tiles(tn)))
                k_cover[(tm, tn)] = [(0, self.tile_k_tiles(tn))]
        elif shares_fragments(self.kernel):
            self._split_k_owned(c, writes, order, sk.slices, k_cover)
        elif sk.mode == "split_k":
            ws_writes, ws_expected = self._split_k(c, writes, order, sk.slices, k_cover)
        else:
            self._stream_k(c, writes, order, workers, k_cover)
        for (tm, tn), ranges in k_cover.items():
            covered = sorted(ranges)
            pos = 0
            for kb, ke in covered:
                if kb != pos:
                    raise InterpError(f"tile ({tm}, {tn}): k tiles [{pos}, {kb}) are "
                                      f"{'skipped' if kb > pos else 'accumulated twice'}")
                pos = ke
            if pos != self.tile_k_tiles(tn):
                raise InterpError(f"tile ({tm}, {tn}): k tiles [{pos}, {self.tile_k_tiles(tn)}) never accumulated")
        if self.tma_view:
            self.tail(c, writes)
        _check_once(writes, "C")
        if ws_writes is not None:
            _check_once(ws_writes, "the split-K workspace", ws_expected)
        return InterpResult(c, order, writes, ws_writes, k_cover, repack_writes)

    # ---- tile.cluster with TMA multicast ---------------------------------------------------------------------
    def _cluster_feed(self, mc: ClusterMulticast, blocks: list[tuple[int, int]], first: int):
        """The stages a cluster delivers (l2ir.indexing.ClusterMulticast): `feed(kt, dst)` -> block dst's A and B
        tiles of k tile kt, assembled from the share each block of `blocks` (the cluster's tiles, by rank) loads at
        its own tile and writes into the blocks its masks name; every row of both boxes must arrive exactly once.
        The empty barriers' arrivals are counted too: each block's must receive release_arrivals per phase from the
        blocks its stages are filled from."""
        size, warps = mc.size, self.kernel.tile.warps[0] * self.kernel.tile.warps[1]
        # Shares, masks and releases depend on the rank alone: the same in every cluster.
        env = {"rank": np.arange(size, dtype=np.int64)}
        a_first, b_first = mc.a_first(self.bm).eval(env), mc.b_first(self.bn).eval(env)
        a_mask, b_mask = mc.a_mask().eval(env), mc.b_mask().eval(env)
        release = mc.release_mask().eval(env)
        arrivals = [sum(warps for src in range(size) if release[src] >> dst & 1) for dst in range(size)]
        if arrivals != [mc.release_arrivals(warps)] * size:
            raise InterpError(f"cluster {mc.cm}x{mc.cn}: empty barriers receive {arrivals} warp arrivals a "
                              f"phase, initialized for {mc.release_arrivals(warps)}")
        a_rows, b_rows = mc.a_rows(self.bm), mc.b_rows(self.bn)

        def feed(kt: int, dst: int):
            a_t = np.zeros((self.bm, self.bk), dtype=self.in_dtype)
            b_t = np.zeros((self.bn, self.bk), dtype=self.in_dtype)
            got_a, got_b = np.zeros(self.bm, np.int32), np.zeros(self.bn, np.int32)
            for src, (stm, stn) in enumerate(blocks):
                if a_mask[src] >> dst & 1:
                    r0 = int(a_first[src])
                    a_t[r0:r0 + a_rows] = self._tile(self.a, stm * self.bm + r0, a_rows, kt * self.bk, self.bk,
                                                     "m", "k")
                    got_a[r0:r0 + a_rows] += 1
                if b_mask[src] >> dst & 1:
                    r0 = int(b_first[src])
                    b_t[r0:r0 + b_rows] = self._tile(self.b.T, stn * self.bn + r0, b_rows, kt * self.bk,
                                                     self.bk, "n", "k")
                    got_b[r0:r0 + b_rows] += 1
            _check_once(got_a, f"block {first + dst}'s A stage (rows from its cluster)")
            _check_once(got_b, f"block {first + dst}'s B stage (rows from its cluster)")
            return a_t, b_t

        return feed

    def _multicast(self, c, writes, order, mc: ClusterMulticast, k_cover: dict) -> None:
        """One tile per block in clusters of mc.size consecutive blocks (l2ir.indexing.ClusterMulticast): each block
        accumulates every k tile from the stages its cluster delivers (`_cluster_feed`), so a share taken from
        another block's tile shows in C."""
        for first in range(0, len(order), mc.size):
            blocks = order[first:first + mc.size]
            feed = self._cluster_feed(mc, blocks, first)
            for dst, (tm, tn) in enumerate(blocks):
                acc = self.mainloop(tm, tn, 0, self.k_tiles, feed=lambda kt, d=dst, f=feed: f(kt, d))
                if tm < self.tiles_m and tn < self.tiles_n:
                    self.store(c, writes, tm, tn, acc)
                    k_cover[(tm, tn)] = [(0, self.k_tiles)]

    def _multicast_partials(self, order, mc: ClusterMulticast, slices: int, k_cover: dict):
        """split-K in multicast clusters: `partial(slice, index)` -> the fp32 partial of block `index` of the
        slice's cluster grid (launch block ClusterMulticast.unit: slice * blocks + index, checked here), accumulated
        over its slice's k tiles (l2ir.indexing.splitk_range) from the stages its cluster delivers."""
        blocks_per_slice = int(mc.blocks().eval({"tiles_m": self.tiles_m, "tiles_n": self.tiles_n}))
        if blocks_per_slice != len(order):
            raise InterpError(f"cluster {mc.cm}x{mc.cn}: {len(order)} blocks a slice, ClusterMulticast.blocks says "
                              f"{blocks_per_slice}")
        pid_of, slice_of = mc.unit()
        begin, end = splitk_range(slices)
        feeds: dict = {}

        def partial(slice_: int, index: int) -> np.ndarray:
            unit = slice_ * blocks_per_slice + index
            env = {"unit": unit, "tiles_m": self.tiles_m, "tiles_n": self.tiles_n}
            if (int(pid_of.eval(env)), int(slice_of.eval(env))) != (index, slice_):
                raise InterpError(f"ClusterMulticast.unit sends launch block {unit} elsewhere than block {index} of "
                                  f"slice {slice_}")
            first = index - index % mc.size      # the cluster's first block: all its blocks share the slice
            if first not in feeds:
                feeds[first] = self._cluster_feed(mc, order[first:first + mc.size], first)
            tm, tn = order[index]
            kb, ke = (int(x.eval({"slice": slice_, "k_tiles": self.k_tiles})) for x in (begin, end))
            if ke > kb:
                k_cover.setdefault((tm, tn), []).append((kb, ke))
            feed = feeds[first]
            return self.mainloop(tm, tn, kb, ke, feed=lambda kt: feed(kt, index % mc.size)).astype(np.float32)

        return partial

    # ---- pipeline mode=direct ------------------------------------------------------------------------------
    def _direct(self, c: np.ndarray, writes: np.ndarray, order: list[tuple[int, int]]) -> None:
        """pipeline mode=direct (l2ir.indexing.DirectFeed): every lane's vectors are read from A's and B's memory at
        the offsets the backend renders (chunk_k; pad.align < 8: realigned out of two aligned vectors), each k16 MMA
        takes its fragments by the register tables, and C is stored by the accumulator fragment map."""
        p, kern = self.problem, self.kernel
        steps = self.k_tiles
        chunks = self.bk // DirectFeed.CHUNK_K
        # The K vectors the lanes load: chunk_k over every (step, u, q) must hit each 8-element vector once.
        grid = np.meshgrid(np.arange(steps), np.arange(chunks), np.arange(DirectFeed.LANES_PER_ROW), indexing="ij")
        starts = np.asarray(DirectFeed.chunk_k(self.bk).eval(dict(zip(("step", "u", "q"), grid)))).ravel()
        _check_once(np.bincount(starts // DirectFeed.ELEMS, minlength=steps * self.bk // DirectFeed.ELEMS),
                    "each 8-element K vector (DirectFeed.chunk_k)")
        kpad = steps * self.bk
        a_eff = _direct_rows(self.a, p.k, kpad, kern.pad.align, "A")          # M x kpad, zeros past K
        b_eff = _direct_rows(self.b.T, p.k, kpad, kern.pad.align, "B").T      # kpad x N
        phys = {op: _direct_feed(op) for op in ("A", "B")}
        # K slices (splitk reduce=block): slice s's warps take steps slice_step(S) in order; slice 0 then adds the
        # other slices' accumulators in slice order. Every step must be taken by exactly one slice.
        slices = direct_slices(kern)
        taken = np.zeros(steps, dtype=np.int64)
        partials = []
        for sl in range(slices):
            acc = np.zeros((p.m, p.n), dtype=np.float32)
            for i in range(int(DirectFeed.slice_steps(slices).eval({"slice": sl, "k_tiles": steps}))):
                step = int(DirectFeed.slice_step(slices).eval({"slice": sl, "i": i}))
                if not 0 <= step < steps:
                    raise InterpError(f"direct split: slice {sl}'s step {i} is k step {step} of {steps}")
                taken[step] += 1
                for u in range(chunks):                     # two MMAs per chunk
                    k0 = step * self.bk + u * DirectFeed.CHUNK_K
                    for h in range(DirectFeed.MMAS_PER_CHUNK):
                        acc += (a_eff[:, k0 + phys["A"][h]].astype(np.float32)
                                @ b_eff[k0 + phys["B"][h], :].astype(np.float32))
            partials.append(acc)
        _check_once(taken, "each k step (DirectFeed.slice_step)")
        acc = partials[0]
        for part in partials[1:]:
            acc = acc + part
        out = acc.astype(self.out_dtype)
        mi, ni, _ = direct_shape(kern)
        wn = kern.tile.warps[1]
        g, q, w, i, j, r = np.meshgrid(np.arange(8), np.arange(4), np.arange(wn), np.arange(mi), np.arange(ni),
                                       np.arange(4), indexing="ij")
        row_off = (16 * i + g + np.take(DirectFeed.C_ROW, r)).ravel()
        col_off = (w * ni * 8 + 8 * j + 2 * q + np.take(DirectFeed.C_COL, r)).ravel()
        if direct_half_fed(kern):                           # rows g + 8 of the MMA are not this tile's
            keep = row_off < 8
            row_off, col_off = row_off[keep], col_off[keep]
        for tm, tn in order:
            rows, cols = tm * self.bm + row_off, tn * self.bn + col_off
            ok = (rows < p.m) & (cols < p.n)
            c[rows[ok], cols[ok]] = out[rows[ok], cols[ok]]
            np.add.at(writes, (rows[ok], cols[ok]), 1)

    def _slice_partial(self, tm: int, tn: int, slice_: int, slices: int, k_cover: dict) -> np.ndarray:
        """One split-K block's fp32 partial: output tile (tm, tn) over its slice's k tiles (l2ir.indexing.splitk_range),
        whose range it records in `k_cover`."""
        begin, end = splitk_range(slices)
        env = {"slice": slice_, "k_tiles": self.tile_k_tiles(tn)}
        kb, ke = int(begin.eval(env)), int(end.eval(env))
        if ke > kb:
            k_cover.setdefault((tm, tn), []).append((kb, ke))
        return self.mainloop(tm, tn, kb, ke).astype(np.float32)

    def _split_k(self, c, writes, order, slices, k_cover, partial=None):
        """Split-K as the backends run it (l2ir.indexing.SplitKTree): each (tile, slice) block accumulates its slice's
        k tiles, then climbs the tile's pairwise tree: at each pair it stores its registers to workspace slot
        `base` and counts itself in on the pair's counter; the first arrival is done, the second adds the sibling
        slot, resets the counter and climbs on; the block that finishes the root stores C. Blocks run one after the
        other in `_splitk_arrivals` order, one legal interleaving of the kernel (every order gives the same bits).
        Returns (the workspace write counts, the counts the tree's shape expects: SplitKTree.slot_writes); every
        counter must be back at zero (the next launch relies on it). `partial(slice, index)` gives block `index`'s
        partial (default: its slice of its tile, loaded alone); a block whose tile lies past the grid (a multicast
        cluster's) only loads for the others and takes no part in the tree."""
        p = self.problem
        tree = SplitKTree(slices)
        ws = np.full((slices, p.m, p.n), np.nan, dtype=np.float32)
        ws_writes = np.zeros((slices, p.m, p.n), dtype=np.int32)
        counters = {tile: np.zeros(tree.counters, dtype=np.int64) for tile in order
                    if tile[0] < self.tiles_m and tile[1] < self.tiles_n}
        self._check_slots(order, counters)
        if partial is None:
            def partial(slice_: int, index: int) -> np.ndarray:
                return self._slice_partial(*order[index], slice_, slices, k_cover)
        for unit in _splitk_arrivals(len(order) * slices):
            # unit = slice * (blocks a slice) + block: tiles, or a multicast cluster grid (ClusterMulticast.unit)
            s, (tm, tn) = unit // len(order), order[unit % len(order)]
            if (tm, tn) not in counters:
                continue          # a cluster's block past the grid: its loads fed the others, it has no tile
            acc = partial(s, unit % len(order))
            # The tile's elements inside C, at their places in C (interleave: columns 8 apart).
            rows, cols = tm * self.bm + np.arange(self.bm), self.tile_cols(tn)
            inside = np.ix_(rows < p.m, cols < p.n)
            at = np.ix_(rows[rows < p.m], cols[cols < p.n])
            root = True
            for step in tree.steps(s):
                ws[step.base][at] = acc[inside]
                ws_writes[step.base][at] += 1
                node = counters[(tm, tn)]
                node[step.counter] += 1
                if node[step.counter] == 1:
                    root = False          # first of the pair: the sibling's block carries the sum on
                    break
                if node[step.counter] != 2:
                    raise InterpError(f"tile ({tm}, {tn}): split-K counter {step.counter} counted "
                                      f"{int(node[step.counter])} arrivals; a pair node takes two")
                node[step.counter] = 0
                acc[inside] = acc[inside] + ws[step.sibling][at]
            if root:
                # The reduction's root block writes C through the same vector stores as the epilogue.
                tile = np.zeros((self.bm, self.bn), dtype=np.float32)
                tile[inside] = acc[inside]
                self.store(c, writes, tm, tn, tile)
        for (tm, tn), node in counters.items():
            if node.any():
                raise InterpError(f"tile ({tm}, {tn}): split-K counters {np.flatnonzero(node).tolist()} left "
                                  "non-zero after the launch (the next launch would miscount)")
        expected = np.zeros_like(ws_writes)
        expected[...] = np.array(tree.slot_writes(), dtype=np.int32)[:, None, None]
        return ws_writes, expected

    def _check_slots(self, order, tiles) -> None:
        """The workspace slot each tile's blocks use (its partials and pair counters) as the backends render it: the
        block's place in the tile grid (pid), or with a multicast cluster grid the tile's own index
        (ClusterMulticast.slot). Slots must lie inside the workspace (num_tiles of them) and never be shared by two
        tiles, or one tile's partial would be summed into another's."""
        mc = multicast(self.kernel)
        owner: dict[int, tuple[int, int]] = {}
        for index, tile in enumerate(order):
            if tile not in tiles:
                continue
            slot = index if mc is None else int(ClusterMulticast.slot().eval(
                {"tile_m": tile[0], "tile_n": tile[1], "tiles_m": self.tiles_m, "tiles_n": self.tiles_n}))
            if not 0 <= slot < self.tiles_m * self.tiles_n:
                raise InterpError(f"tile {tile}: split-K workspace slot {slot} outside the workspace's "
                                  f"{self.tiles_m * self.tiles_n} tiles")
            if owner.setdefault(slot, tile) != tile:
                raise InterpError(f"tiles {owner[slot]} and {tile} share split-K workspace slot {slot}")

    def _split_k_owned(self, c, writes, order, slices, k_cover):
        """Split-K reduced through shared memory with the fragment ownership of l2ir.indexing.ClusterReduce: the
        tile's `slices` blocks of a thread-block cluster (reduce=cluster, through `_cluster_push`), or the block's
        two consumer warpgroups fed from one ring (reduce=block, `_block_split_partials`), accumulate their slices'
        k tiles; rank `rank` then stores only the fragment units `owner` gives it, each the sum of all the partials
        in slice order. An ownership map that hands units to ranks that do not exist leaves elements of C
        unwritten, which the final write count catches."""
        cr = ClusterReduce(slices)
        warpgroups = warpgroups_m(self.kernel)
        rows, cols = np.arange(self.bm)[:, None], np.arange(self.bn)[None, :]
        fragment = np.broadcast_to(cr.fragment_of(self.bm // warpgroups, self.bn).eval({"row": rows, "col": cols}),
                                   (self.bm, self.bn))
        owner = np.broadcast_to(cr.owner.eval({"fragment": fragment}), (self.bm, self.bn))
        for tm, tn in order:
            if block_reduce(self.kernel):
                partials = self._block_split_partials(tm, tn, k_cover)
                total = cr.reduce(partials)
            else:
                partials = [self._slice_partial(tm, tn, s, slices, k_cover) for s in range(slices)]
                total = self._cluster_push(cr, partials, fragment, owner, warpgroups)
            for rank in range(slices):
                self.store(c, writes, tm, tn, total, mask=owner == rank)

    def _cluster_push(self, cr: ClusterReduce, partials, fragment, owner, warpgroups) -> np.ndarray:
        """reduce=cluster's transport: each block pushes the elements of the units it does not own into the owner's
        receive buffer (poisoned with NaN) at float receive_vec * 4 + position_of, the float4 of the consumer thread
        (thread_of) that holds them; each owner then adds, for the units it owns, its own partial and what the
        others pushed, in slice order. Every float of a buffer that is written must be written once (two pushes to
        one float would race), and the floats an owner receives must be what its mbarrier expects
        (receive_bytes): fewer never complete its phase, more complete it before the rest have landed. Returns the
        tile of sums (each owner's elements; what it did not receive reads as NaN)."""
        slices, threads = cr.slices, warpgroups * 128
        units = cr.units(self.bm // warpgroups, self.bn)
        rows, cols = np.arange(self.bm)[:, None], np.arange(self.bn)[None, :]
        env = {"row": rows, "col": cols}
        thread = np.broadcast_to(cr.thread_of(self.bm // warpgroups).eval(env), (self.bm, self.bn))
        position = np.broadcast_to(cr.position_of().eval(env), (self.bm, self.bn))
        floats = 4 * cr.receive_vecs(units, threads)
        buffers = np.full((slices, floats), np.nan, dtype=np.float32)
        counts = np.zeros((slices, floats), dtype=np.int32)
        masks = [owner == rank for rank in range(slices)]
        placed = {}                     # (sender, owner): the floats its pushes land on, where the owner reads them
        for sender in range(slices):
            for rank in range(slices):
                mask = masks[rank]
                if rank == sender or not mask.any():
                    continue
                vec = cr.receive_vec(units, threads).eval({"sender": sender, "owner": rank,
                                                           "fragment": fragment[mask], "ct": thread[mask]})
                at = placed[sender, rank] = 4 * np.asarray(vec) + position[mask]
                if at.min() < 0 or at.max() >= floats:
                    raise InterpError(f"reduce=cluster: block {sender} pushes outside block {rank}'s receive buffer "
                                      f"of {floats} floats (float {int(at.max())})")
                buffers[rank, at] = partials[sender][mask]
                np.add.at(counts[rank], at, 1)
        total = np.full((self.bm, self.bn), np.nan, dtype=np.float32)
        for rank in range(slices):
            if (counts[rank] > 1).any():
                raise InterpError(f"reduce=cluster: two pushes land on one float of block {rank}'s receive buffer")
            expected = int(cr.receive_bytes(units, threads).eval({"slice": rank}))
            if 4 * int(counts[rank].sum()) != expected:
                raise InterpError(f"reduce=cluster: block {rank} receives {4 * int(counts[rank].sum())} bytes, its "
                                  f"mbarrier expects {expected}")
            mask = masks[rank]
            if not mask.any():
                continue
            terms = [partials[rank][mask] if r == rank else buffers[rank, placed[r, rank]] for r in range(slices)]
            total[mask] = cr.reduce(terms)
        return total

    def _stream_k(self, c, writes, order, workers, k_cover):
        """A persistent grid of `workers` blocks splits tiles*k_tiles MAC iterations evenly; each tile's segments are
        summed in k order in fp32 (the fix-up) and the tile is stored once."""
        total = len(order) * self.k_tiles
        workers = max(1, min(workers, total))
        partials: dict = {}
        for w in range(workers):
            it, end = w * total // workers, (w + 1) * total // workers
            while it < end:
                t, kb = divmod(it, self.k_tiles)
                ke = min(self.k_tiles, kb + (end - it))
                tm, tn = order[t]
                partials.setdefault((tm, tn), []).append((kb, ke, self.mainloop(tm, tn, kb, ke)))
                k_cover.setdefault((tm, tn), []).append((kb, ke))
                it += ke - kb
        for tm, tn in order:
            segs = sorted(partials.get((tm, tn), []), key=lambda s: s[0])
            acc = np.zeros((self.bm, self.bn), dtype=np.float32)
            for _, _, part in segs:
                acc += part.astype(np.float32)
            self.store(c, writes, tm, tn, acc)


def _repack(kernel: Kernel, problem: Problem, a: np.ndarray, b: np.ndarray):
    """The repack kernel, then the operands as the GEMM reads them (l2ir.indexing.Repack). Each operand the node
    copies and whose rows are misaligned is written chunk by chunk, as the kernel's loop does, into a flat workspace
    (poisoned with NaN) at its copy's offset plus `dst`, zeros in the pad columns, and read back as rows of `pitch`
    elements from the copy's offset. A wrong offset, pitch or element map reads poison or another operand, and shows in C; every
    element of a copy must be written exactly once and nothing outside the copies at all; copies start and rows
    step on REPACK_ALIGN elements (what the GEMM's 16-byte loads need).
    Returns (A, B, the workspace's write counts)."""
    rp = Repack(kernel.repack.operands, problem.a[1], problem.b[1])
    env = {"m": problem.m, "n": problem.n, "k": problem.k}
    total = int(rp.end.eval(env))
    ws = np.full(total, np.nan, dtype=a.dtype)
    writes = np.zeros(total, dtype=np.int32)
    expected = np.zeros(total, dtype=np.int32)
    read = {}
    for op, logical, layout in (("A", a, problem.a[1]), ("B", b, problem.b[1])):
        stored = logical if layout == "row" else logical.T
        if int(rp.copy_elems(op).eval(env)) == 0:
            read[op] = logical                       # aligned, or not the node's: read in place
            continue
        rows, cols = stored.shape
        pitch = int(rp.pitch(cols).eval({}))
        base = int(rp.offset(op).eval(env))
        if pitch % REPACK_ALIGN or base % REPACK_ALIGN:
            raise InterpError(f"repack copy of {op} at element {base} with rows of {pitch}: the GEMM's 16-byte loads "
                              f"need both to be multiples of {REPACK_ALIGN}")
        # The kernel's loop: chunk -> (row, first column); one 16-byte store of REPACK_ALIGN elements at `dst` of the
        # first, the source elements past `cols` replaced by zeros.
        chunk = np.arange(int(Repack.chunks(rows, cols).eval({})), dtype=np.int64)
        r = Repack.chunk_row().eval({"chunk": chunk, "cols": cols})
        c0 = Repack.chunk_col().eval({"chunk": chunk, "cols": cols})
        start = base + Repack.dst().eval({"row": r, "col": c0, "cols": cols})
        if np.any(start % REPACK_ALIGN):
            raise InterpError(f"repack of {op}: a 16-byte store at element {int(start[start % REPACK_ALIGN != 0][0])} "
                              "is not 16-byte aligned")
        col = c0[:, None] + np.arange(REPACK_ALIGN)[None, :]
        dst = start[:, None] + np.arange(REPACK_ALIGN)[None, :]
        if dst.size and (dst.min() < 0 or dst.max() >= total):
            raise InterpError(f"repack of {op} writes workspace elements [{dst.min()}, {dst.max()}] outside the "
                              f"{total} the copies take")
        src = Repack.src().eval({"row": r[:, None], "col": np.minimum(col, cols - 1), "cols": cols})
        ws[dst] = np.where(col < cols, stored.ravel()[src], 0)
        np.add.at(writes, dst.ravel(), 1)
        expected[base:base + rows * pitch] = 1
        view = ws[base:base + rows * pitch].reshape(rows, pitch)[:, :cols]
        read[op] = view if layout == "row" else view.T
    _check_once(writes, "the repack workspace", expected)
    return read["A"], read["B"], writes


def _direct_feed(op: str) -> list[np.ndarray]:
    """Per k16 MMA h of a chunk: the chunk-relative K element behind each of the MMA's 16 K positions, read off the
    fragment tables of `op` (DirectFeed.A_* or B_*) for all 4 lanes of a row. Raises InterpError unless every K
    position is fed exactly once (for A, in both row halves of the m16 block)."""
    F = DirectFeed
    regs = ((F.A_KPOS, F.A_WORD, F.A_ROW) if op == "A" else (F.B_KPOS, F.B_WORD, (0,) * len(F.B_KPOS)))
    out = []
    for h in range(F.MMAS_PER_CHUNK):
        src = np.full((2, 16), -1, dtype=np.int64)
        count = np.zeros((2, 16), dtype=np.int64)
        for q in range(F.LANES_PER_ROW):
            for kpos, word, row in zip(*regs):
                for t in range(2):
                    pos = 2 * q + kpos + t
                    src[row // 8, pos] = int(F.physical_k(h, word).eval({"q": q})) + t
                    count[row // 8, pos] += 1
        halves = count[:1] if op == "B" else count
        if not (halves == 1).all():
            raise InterpError(f"direct feed: {op}'s fragment tables feed MMA K positions "
                              f"{np.argwhere(halves != 1)[:, 1].tolist()} {halves.max()} or 0 times, not once")
        if op == "A" and not (src[0] == src[1]).all():
            raise InterpError("direct feed: A's rows g and g + 8 take different K elements for one K position")
        out.append(src[0])
    return out


def _direct_rows(x: np.ndarray, k: int, kpad: int, align: int, name: str) -> np.ndarray:
    """What a direct kernel's lanes hold for each row of `x` (rows x K, K contiguous, rows K apart in memory): the
    8-element vectors at 0, 8, ... < kpad, zero past K. pad.align < 8 loads the aligned vector below each and, where
    DirectFeed.realign_needs_upper says so, the next, from a flat copy of the operand whose ends are poisoned with
    NaN; a lower vector outside the operand raises (an out-of-bounds read)."""
    rows = x.shape[0]
    flat = np.ascontiguousarray(x).ravel()
    out = np.zeros((rows, kpad), dtype=x.dtype)
    if align == 8:
        out[:, :k] = x
        return out
    pad = 16
    mem = np.concatenate([np.full(pad, np.nan, x.dtype), flat, np.full(pad, np.nan, x.dtype)])
    for r in range(rows):
        for k0 in range(0, kpad, DirectFeed.ELEMS):
            if k0 >= k:
                break
            elem = pad + r * k + k0                       # the operand's base is 16-byte aligned in the model
            off = int(DirectFeed.realign_offset().eval({"elem": elem - pad}))
            lo_at = elem - off
            if (lo_at - pad) % DirectFeed.ELEMS:
                raise InterpError(f"direct feed: {name} row {r} at k={k0}: the lower vector at element "
                                  f"{lo_at - pad} is not 16-byte aligned (realign_offset)")
            if lo_at + DirectFeed.ELEMS <= pad or lo_at >= pad + flat.size:
                raise InterpError(f"direct feed: {name} row {r} reads a vector outside the operand at k={k0}")
            vec = mem[lo_at:lo_at + 2 * DirectFeed.ELEMS].copy()
            if not DirectFeed.realign_needs_upper(off, k0, k):
                vec[DirectFeed.ELEMS:] = 0                # the upper vector is not loaded: zeros in registers
            got = vec[off:off + DirectFeed.ELEMS]
            keep = min(DirectFeed.ELEMS, k - k0)
            out[r, k0:k0 + keep] = got[:keep]
            if np.isnan(got[:keep].astype(np.float32)).any():
                raise InterpError(f"direct feed: {name} row {r} at k={k0} took poison from outside the operand")
    return out


def _splitk_arrivals(units: int) -> range:
    """The order the interpreter runs split-K's (tile, slice) blocks in: launch order. The kernel's result does not
    depend on it (tests run other orders and compare bits)."""
    return range(units)


def _check_once(writes: np.ndarray, what: str, expected: np.ndarray | int = 1) -> None:
    """Every element written exactly `expected` times: once for C; for the split-K workspace, the tree's count per
    slot (SplitKTree.slot_writes: a slot is rewritten with each subtree sum it is the base of)."""
    bad = np.argwhere(writes != expected)
    if len(bad):
        idx = tuple(int(i) for i in bad[0])
        want = int(np.broadcast_to(expected, writes.shape)[idx])
        raise InterpError(f"{len(bad)} element(s) of {what} written a wrong number of times; first {idx} "
                          f"written {int(writes[idx])} times, expected {want}")


def interpret(kernel: Kernel, problem: Problem, a: np.ndarray, b: np.ndarray,
              workers: int = DEFAULT_WORKERS) -> InterpResult:
    """Run `kernel` on logical A (MxK) and B (KxN); raises the verifier's error if the kernel cannot run this
    problem, and InterpError if the schedule does not write every output element exactly once."""
    if kernel.is_source:
        raise InterpError("a Source kernel is free-form CUDA with no schedule to interpret; "
                          "the GPU evaluator checks it")
    check_problem(kernel, problem)
    if a.shape != (problem.m, problem.k) or b.shape != (problem.k, problem.n):
        raise InterpError(f"operands {a.shape} x {b.shape} do not match the problem {problem.m}x{problem.n}x"
                          f"{problem.k} (A is MxK, B is KxN)")
    return _Schedule(kernel, problem, a, b).run(workers)
