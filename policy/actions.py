"""The edit operators: a flat list of frozen records, one per (knob, value), over the whole IR and every backend.

An `Action("stages", 4)` is an intent; `apply_action` turns it into the child kernel, fixing up what the knob drags
along (a wgmma tile's MMA shape follows its BN, a cooperative tile has two consumer warpgroups, a smaller BK takes
a narrower shared-memory swizzle), and `diff_edits` writes the difference as L2IR edits (`set pipeline.stages = 4`,
`replace tile with ...`, `insert splitk ...`, `remove splitk`). The random policy draws knobs and values uniformly;
the learned policy puts a distribution over `ACTIONS`. Whether a child is legal is decided only by the verifier, the
problem rules and the backend (`policy.base.legalize`), never here.

Moving between rules: `Action("rules", "sm80")` rewrites a TMA + wgmma warp-specialized kernel as the sm80 rule
(cp.async multistage + mma.sync, target sm80, which Hopper runs too) and `Action("rules", "sm90a")` the reverse, when
the GPU is sm90a. `Action("backend", name)` asks for another backend for the same kernel (CUTLASS sm90 or raw
CUDA/PTX for wgmma kernels; CuTe or raw CUDA/PTX for mma.sync kernels).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from l2ir.edits import Edit, InsertNode, RemoveNode, ReplaceNode, SetField
from l2ir.errors import L2IRError
from l2ir.nodes import (KERNEL_ORDER, Epilogue, Interleave, Kernel, Mma, Pad, Pipeline, Problem, Repack, SplitK,
                        Swizzle, Target, Tile)
from l2ir.analysis import block_reduce, shares_fragments
from l2ir.seed import alignment, store_vector
from l2ir.verify import violations

HOPPER = ("sm90", "sm90a")

KNOBS: dict[str, tuple[Any, ...]] = {
    "block": tuple((bm, bn, bk) for bm in (32, 64, 128, 256) for bn in (32, 64, 128, 256) for bk in (32, 64)),
    "warps": ((1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2)),
    "cluster": ((1, 1), (2, 1), (1, 2), (2, 2)),
    "stages": (2, 3, 4, 5, 6, 7, "auto"),
    "schedule": ("cooperative", "pingpong"),
    "persistent": (True, False),
    "prefetch": (True, False),
    "raster": ("along_m", "along_n"),
    "group": (1, 2, 4, 8, 16),
    "smem_swizzle": (None, (1, 3, 3), (2, 3, 3), (3, 3, 3)),
    "splitk": (None, ("split_k", 2, "workspace"), ("split_k", 3, "workspace"), ("split_k", 4, "workspace"),
               ("split_k", 8, "workspace"), ("split_k", 16, "workspace"), ("split_k", 4, "atomic"),
               ("stream_k", 1, "workspace"), ("split_k", 4, "cluster"), ("split_k", 8, "cluster"),
               ("split_k", 16, "cluster"), ("split_k", 2, "block")),
    "epilogue_path": ("direct", "smem", "tma"),
    "epilogue_vector": (1, 2, 4, 8),
    "pad": tuple((dim, mode) for dim in "mnk" for mode in ("predicate", "zero_fill", "divisible")),
    "align": (1, 2, 4, 8),
    "repack": (None, "ab"),
    "interleave": (None, 8),
    "rules": ("sm80", "sm90a"),
    "arch": ("sm80", "sm90"),
    "backend": ("cutlass_sm90", "cuda_ptx", "cute_sm80", "cuda_ptx_sm80"),
}


@dataclass(frozen=True)
class Action:
    knob: str
    value: Any

    def __str__(self):
        v = self.value
        if isinstance(v, tuple):
            v = ("x" if all(isinstance(x, int) for x in v) else ":").join(map(str, v))
        return f"{self.knob}={'none' if v is None else v}"


ACTIONS: tuple[Action, ...] = tuple(Action(k, v) for k, vs in KNOBS.items() for v in vs)


# ---------------------------------------------------------------------------------------------------------------
# Fix-ups: what a knob drags along.
# ---------------------------------------------------------------------------------------------------------------


def _fit_swizzle(sw: Swizzle | None, bk: int, tma: bool) -> Swizzle | None:
    """Swizzle<B,3,S> permutes rows of 2^(B+3) elements, so a narrower BK takes fewer bits; TMA takes S = 3."""
    if sw is None or sw.smem is None:
        return sw
    b, m, s = sw.smem
    b = min(b, max(1, (bk.bit_length() - 1) - 3))
    s = 3 if tma else max(s, b)
    return dataclasses.replace(sw, smem=(b, m, s))


_SM80_WARPS = ((2, 2), (2, 4), (4, 2), (2, 1), (1, 2), (4, 4), (1, 1), (4, 1), (1, 4))


def refit(k: Kernel) -> Kernel:
    """Make the fields that follow others consistent: wgmma shape and warpgroups per schedule, no register prefetch
    or predicated loads under TMA, the swizzle width for BK, and mma.sync warps that divide the tile."""
    if k.is_source:
        return k
    t, p = k.tile, k.pipeline
    if k.mma.op == "wgmma":
        # One wgmma spans the warpgroup's whole N; cooperative tiles stack two consumer warpgroups along M.
        warps = (8, 1) if p.schedule == "cooperative" else (4, 1)
        pad = k.pad
        for dim in "mnk":
            if getattr(pad, dim) == "predicate":
                pad = dataclasses.replace(pad, **{dim: "zero_fill"})
        k = k.replace(tile=dataclasses.replace(t, warps=warps),
                      mma=Mma("wgmma", (64, min(256, t.bn), 16)),
                      pipeline=dataclasses.replace(p, prefetch=False, schedule=p.schedule if p.schedule != "none"
                                                   else "pingpong"),
                      pad=pad, swizzle=_fit_swizzle(k.swizzle, t.bk, True))
        return k
    k = k.replace(swizzle=_fit_swizzle(k.swizzle, t.bk, False))
    if not violations(k):
        return k
    for warps in (t.warps,) + _SM80_WARPS:
        cand = k.replace(tile=dataclasses.replace(t, warps=warps))
        if not violations(cand):
            return cand
    return k


def to_sm80(k: Kernel, problem: Problem) -> Kernel:
    """The sm80 rule for the same tile: cp.async multistage ring + mma.sync, predicated M/N, the C tile staged
    through shared memory (the ring is drained by then, so it costs no extra shared memory)."""
    align = alignment(problem)
    bm, bn, bk = k.tile.block
    sk = k.splitk
    if sk is not None and sk.mode == "stream_k":
        sk = None    # no persistent scheduler on the sm80 rule
    sw = k.swizzle or Swizzle()
    out = Kernel(
        target=Target("sm80"),
        tile=Tile(block=(bm, bn, min(bk, 64)), warps=(2, 2)),
        mma=Mma("mma_sync", (16, 8, 16)),
        pipeline=Pipeline("multistage", 3 if bk >= 64 else 4, prefetch=True),
        swizzle=Swizzle(smem=sw.smem if sw.smem is not None else (3, 3, 3), raster=sw.raster, group=sw.group),
        pad=Pad("predicate", "predicate", "zero_fill", align),
        splitk=sk,
        epilogue=Epilogue("smem", store_vector(problem)),
    )
    return refit(out)


def to_sm90a(k: Kernel) -> Kernel:
    """The TMA warp-specialized rule: a producer warpgroup feeds wgmma consumers; ping-pong for tiles of one
    warpgroup, cooperative for 256-row tiles; stages fill the shared memory the epilogue leaves."""
    bm, bn, _ = k.tile.block
    bm = min(256, max(64, bm))
    bn = min(256, max(64, bn))
    schedule = "cooperative" if bm >= 256 else "pingpong"
    sk = k.splitk
    if sk is not None:
        # Split-K on Hopper runs on CUTLASS's stream-K scheduler, which only the cooperative kernel has.
        schedule = "cooperative"
        bm = max(bm, 128)
        sk = SplitK("stream_k")
    sw = k.swizzle or Swizzle()
    group = sw.group if sw.group in (1, 2, 4, 8) else 8
    out = Kernel(
        target=Target("sm90a"),
        tile=Tile(block=(bm, bn, 64), warps=(4, 1)),
        mma=Mma("wgmma", (64, bn, 16)),
        pipeline=Pipeline("tma_ws", "auto", schedule=schedule, persistent=True),
        swizzle=Swizzle(smem=(3, 3, 3), raster=sw.raster, group=group),
        pad=Pad("zero_fill", "zero_fill", "zero_fill", 8),
        splitk=sk,
        epilogue=Epilogue("tma", 8),
    )
    return refit(out)


def _set(node, **changes):
    try:
        return dataclasses.replace(node, **changes)
    except L2IRError:
        return None


def default_backend(kernel: Kernel) -> str | None:
    from l2ir.backends.registry import backend_for

    try:
        return backend_for(kernel).name
    except NotImplementedError:
        return None


def normal_backend(kernel: Kernel, backend: str | None) -> str | None:
    """None for the registry's default, and for a backend that does not take this kernel (a move between rules
    leaves the old rule's backend behind)."""
    if backend is None:
        return None
    from l2ir.backends.registry import BACKENDS

    b = BACKENDS.get(backend)
    # A backend that is the default only for some kernels (cuda_ptx for split-K in a cluster) keeps its name: a
    # child that leaves that kind would otherwise move to another backend unasked.
    if b is None or not b.accepts(kernel) or (b.default is True and backend == default_backend(kernel)):
        return None
    return backend


def apply_action(kernel: Kernel, problem: Problem, action: Action, arch: str = "sm90a",
                 backend: str | None = None) -> tuple[Kernel, str | None] | None:
    """The child kernel and backend this action makes, or None when it does not apply (a Source kernel, a knob of
    the other rule, the value the kernel already has). The child is not yet checked for legality."""
    if kernel.is_source:
        return None
    knob, v = action.knob, action.value
    t, p, sw = kernel.tile, kernel.pipeline, kernel.swizzle or Swizzle()
    tma = p.mode == "tma_ws"
    new: Kernel | None = None
    if knob in ("block", "warps", "cluster"):
        if knob == "warps" and tma:
            return None          # fixed by the schedule
        node = _set(t, **{knob: v})
        new = node and kernel.replace(tile=node)
    elif knob == "stages":
        if tma and block_reduce(kernel) and v != "auto" and v % 2:
            return None          # reduce=block rings are even (l2ir.indexing.BlockSplit)
        new = kernel.replace(pipeline=dataclasses.replace(p, stages=v))
    elif knob in ("schedule", "persistent"):
        if not tma:
            return None
        new = kernel.replace(pipeline=dataclasses.replace(p, **{knob: v}))
    elif knob == "prefetch":
        if tma:
            return None
        new = kernel.replace(pipeline=dataclasses.replace(p, prefetch=v))
    elif knob == "raster":
        new = kernel.replace(swizzle=dataclasses.replace(sw, raster=v))
    elif knob == "group":
        new = kernel.replace(swizzle=dataclasses.replace(sw, group=v))
    elif knob == "smem_swizzle":
        new = kernel.replace(swizzle=dataclasses.replace(sw, smem=v))
    elif knob == "splitk":
        sk = None if v is None else SplitK(*v)
        new = kernel.replace(splitk=sk)
        if sk is not None and sk.mode == "stream_k" and tma:
            # stream-K splits the MAC loop over a persistent grid.
            new = new.replace(pipeline=dataclasses.replace(p, persistent=True))
        if sk is not None and sk.reduce == "cluster":
            if not tma:
                return None
            # One cluster per tile, the tile's slices its blocks; each block stores its share from registers.
            new = new.replace(tile=dataclasses.replace(t, cluster=(1, 1)),
                              pipeline=dataclasses.replace(p, persistent=False),
                              epilogue=Epilogue("direct", 2))
            backend = "cuda_ptx"          # the backend that lowers it, kept by name for the children
        if sk is not None and sk.reduce == "block":
            if not tma:
                return None
            # The cooperative block's two consumer warpgroups split one tile's K loop, each over all BM rows: one
            # tile per block, an even ring of at least 4 stages (each warpgroup owns its stages: l2ir.indexing.
            # BlockSplit), each warpgroup storing its share from registers.
            stages = p.stages if p.stages == "auto" else max(4, p.stages - p.stages % 2)
            new = new.replace(tile=dataclasses.replace(t, block=(t.bm if t.bm in (64, 128) else 64, t.bn, t.bk),
                                                       cluster=(1, 1)),
                              pipeline=dataclasses.replace(p, schedule="cooperative", persistent=False, stages=stages),
                              epilogue=Epilogue("direct", 2))
            backend = "cuda_ptx"
    elif knob == "epilogue_path":
        new = kernel.replace(epilogue=dataclasses.replace(kernel.epilogue, path=v))
    elif knob == "epilogue_vector":
        new = kernel.replace(epilogue=dataclasses.replace(kernel.epilogue, vector=v))
    elif knob == "pad":
        dim, mode = v
        new = kernel.replace(pad=dataclasses.replace(kernel.pad, **{dim: mode}))
    elif knob == "align":
        new = kernel.replace(pad=dataclasses.replace(kernel.pad, align=v),
                             epilogue=dataclasses.replace(kernel.epilogue,
                                                          vector=min(kernel.epilogue.vector, v)))
    elif knob == "repack":
        if v is None:
            new = kernel.replace(repack=None)
        else:
            if alignment(problem) == 8:
                return None          # every row already aligned: nothing would ever be copied
            if not tma:
                if arch != "sm90a":
                    return None
                kernel = to_sm90a(kernel)    # the copy feeds TMA: the narrow-load sm80 kernel crosses rules with it
            # The copy is generated by cuda_ptx: the nearest kernel it builds, kept on it by name for the children.
            new = fit_backend(kernel.replace(repack=Repack(v), pad=dataclasses.replace(kernel.pad, align=8)),
                              "cuda_ptx")
            backend = "cuda_ptx"
    elif knob == "interleave":
        if v is None:
            new = kernel.replace(interleave=None)
        else:
            if tma or alignment(problem) == 8:
                return None          # an mma.sync ring's node, for rows of B that do not all start 16-byte aligned
            # Blocks of columns 8 apart read rows on any 2-byte boundary (pad.align=1, single-element stores 8 columns
            # apart), through a view of B that starts before each row and ends past N (no divisible n or k), one
            # block per tile. cuda_ptx_sm80 is the backend that lowers the node, kept by name for the children.
            pad = kernel.pad
            pad = dataclasses.replace(pad, align=1, **{d: "zero_fill" for d in "nk" if getattr(pad, d) == "divisible"})
            new = kernel.replace(interleave=Interleave(v), pad=pad, tile=dataclasses.replace(t, cluster=(1, 1)),
                                 epilogue=dataclasses.replace(kernel.epilogue, vector=1))
            backend = "cuda_ptx_sm80"
    elif knob == "rules":
        if v == "sm80":
            if not tma:
                return None
            new = to_sm80(kernel, problem)
        else:
            if tma or arch != "sm90a":
                return None
            new = to_sm90a(kernel)
    elif knob == "arch":
        if tma or (v in HOPPER and arch not in HOPPER):
            return None
        new = kernel.replace(target=Target(v))
    elif knob == "backend":
        from l2ir.backends.registry import BACKENDS

        if not BACKENDS[v].accepts(kernel) or (backend or default_backend(kernel)) == v:
            return None
        kernel = fit_backend(kernel, v)
        return kernel, normal_backend(kernel, v)
    else:
        raise ValueError(f"unknown knob '{knob}' (knobs: {', '.join(KNOBS)})")
    if new is None:
        return None
    if knob != "rules":
        new = refit(new)
    if new == kernel:
        return None
    return new, normal_backend(new, backend)


def fit_backend(k: Kernel, backend: str) -> Kernel:
    """The nearest kernel a backend builds when asked for by name. The raw CUDA/PTX sm90a rule generates cooperative
    kernels (BM a multiple of two 64-row warpgroups) and one-warpgroup ping-pong kernels with a tile per block (not
    persistent), split-K with an in-kernel reduction (the workspace tree, a cluster or the block's two consumer
    warpgroups) but not stream-K or fp32 atomics, no clusters of its own and no TMA store (direct stores of at most
    2 elements, or staged through shared memory); CUTLASS sm90 stages C through shared memory only by the TMA store."""
    if k.is_source or k.mma.op != "wgmma":
        return k
    if backend == "cuda_ptx":
        bm, bn, bk = k.tile.block
        pipe, sk, epi = k.pipeline, k.splitk, k.epilogue
        if sk is not None and (sk.mode != "split_k" or sk.reduce == "atomic"):
            sk = None
        shares = shares_fragments(k)     # one unit per block, each share stored from registers
        if pipe.schedule == "pingpong" or shares:
            pipe = dataclasses.replace(pipe, persistent=False)
        if pipe.schedule != "pingpong" and not block_reduce(k):
            bm = max(128, bm - bm % 128)     # (reduce=block: both warpgroups span BM, any multiple of 64)
        path = epi.path if epi.path in ("direct", "smem") else "smem"
        if shares:
            path = "direct"          # each block (or warpgroup) stores its share straight from registers
        vector = min(epi.vector, 2) if path == "direct" else epi.vector
        k = k.replace(tile=dataclasses.replace(k.tile, block=(bm, bn, bk), cluster=(1, 1)), pipeline=pipe,
                      splitk=sk, epilogue=Epilogue(path, vector))
    elif backend == "cutlass_sm90" and k.epilogue.path == "smem":
        k = k.replace(epilogue=dataclasses.replace(k.epilogue, path="tma"))
    return refit(k)


def legal_children(parent: Kernel, problem: Problem, arch: str, backend: str | None, seen):
    """(index, action, child, backend) for every action that makes a legal child (verifier, problem rules and the
    backend's lowering) not yet in `seen` (a policy.base.Dedupe): the move set every action-ranking policy draws from."""
    from .base import try_legalize

    for i, action in enumerate(ACTIONS):
        made = apply_action(parent, problem, action, arch, backend)
        if made is None:
            continue
        child, child_backend = made
        if try_legalize(child, problem, child_backend) is not None and seen.fresh(child, child_backend):
            yield i, action, child, child_backend


def diff_edits(parent: Kernel, child: Kernel) -> tuple[Edit, ...]:
    """The edits that turn `parent` into `child`, node by node in print order: `set` for a single changed field,
    `replace` for more, `insert` / `remove` for optional nodes that appear or go."""
    out: list[Edit] = []
    for name in KERNEL_ORDER:
        a, b = getattr(parent, name), getattr(child, name)
        if a == b:
            continue
        if name == "swizzle":
            a = a or Swizzle()
            if b is None:
                b = Swizzle()
        if b is None:
            out.append(RemoveNode(name))
        elif a is None:
            out.append(InsertNode(b))
        else:
            changed = [fl.name for fl in dataclasses.fields(b) if getattr(a, fl.name) != getattr(b, fl.name)]
            if len(changed) == 1:
                out.append(SetField(name, changed[0], getattr(b, changed[0])))
            else:
                out.append(ReplaceNode(b))
    return tuple(out)
