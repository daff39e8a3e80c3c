"""Policies: the protocol and registry, random legal edits, expert rules, the learned policy, and the example.

Every proposal of every policy must come out legal (verifier, problem rules, backend lowering) for any problem;
the same context must give the same proposals; the rules must make the library's decisions on characteristic
shapes. The learned policy's tests (test_policy_learned.py) use the synthetic reward defined here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l2ir.edits import parse_edits, print_edits
from l2ir.indexing import ceil_div
from l2ir.nodes import Problem, SplitK
from l2ir.seed import seed, split_tile_kernel
from l2ir.testing import problems
from l2ir.verify import resolved_stages
from l2ir.policy.actions import ACTIONS, KNOBS, Action, apply_action, diff_edits
from l2ir.policy.base import (Context, Feedback, Proposal, StatelessPolicy, get_policy, legalize,
                              policy_names, register_policy)
from l2ir.policy.episodes import climb
from l2ir.policy.random_edits import RandomEdits
from l2ir.policy.rules import Rules, hopper_kernel, tiles_of

ROOT = Path(__file__).resolve().parent.parent
ARCHS = st.sampled_from(["sm90a", "sm80"])


def _check_proposals(context: Context, proposals: list[Proposal]) -> None:
    """Every proposal applies to a legal, lowerable kernel; edits print and parse back; nothing repeats the parent."""
    keys = {context.parent.content_hash() + "|" + (context.backend or "")}
    for p in proposals:
        child = p.apply(context.parent, context.problem)
        legalize(child, context.problem, p.backend)
        if p.edits:
            assert tuple(parse_edits(print_edits(p.edits))) == p.edits
        key = child.content_hash() + "|" + (p.backend or "")
        assert key not in keys, f"duplicate proposal {p.note}"
        keys.add(key)
        assert p.note
    assert len(proposals) <= context.count


# ---------------------------------------------------------------------------------------------------------------
# The protocol and the registry.
# ---------------------------------------------------------------------------------------------------------------


def test_proposal_and_feedback_validate():
    p = Problem(256, 256, 256)
    k = seed(p, "sm80")
    with pytest.raises(ValueError, match="needs edits or a kernel"):
        Proposal()
    with pytest.raises(ValueError, match="not both"):
        Proposal(edits=parse_edits("set pipeline.stages = 2"), kernel=k)
    ctx = Context(p, k)
    prop = Proposal(edits=parse_edits("set pipeline.stages = 2"))
    with pytest.raises(ValueError, match="verdict"):
        Feedback(ctx, prop, "great")
    with pytest.raises(ValueError, match="reward"):
        Feedback(ctx, prop, "measured")
    assert prop.apply(k, p).pipeline.stages == 2
    assert prop.text() == "set pipeline.stages = 2\n"


def test_registry_names_objects_and_plugins():
    assert {"random", "rules", "learned"} <= set(policy_names())
    assert isinstance(get_policy("random"), RandomEdits)
    assert get_policy("random", depth=2).depth == 2
    mine = RandomEdits(tries=3)
    assert get_policy(mine) is mine
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        get_policy("nope")
    with pytest.raises(TypeError, match="not a policy"):
        get_policy(object())
    with pytest.raises(ValueError, match="cannot import"):
        get_policy("l2ir.policy.rules:Missing")
    assert isinstance(get_policy("l2ir.policy.rules:Rules"), Rules)
    register_policy("test-rules", Rules)
    assert isinstance(get_policy("test-rules"), Rules)
    with pytest.raises(ValueError, match="unknown knobs"):
        RandomEdits(knobs=("tile_size",))


def test_block_split_action_makes_an_even_ring():
    """The split-K-inside-one-block action gives the child an even ring of at least 4 stages (an odd ring lets a
    consumer's parity wait pass on the other's unfinished load: l2ir.indexing.BlockSplit), and the child verifies."""
    from l2ir.verify import violations

    p = Problem(1024, 256, 4096)
    parent = split_tile_kernel((64, 64, 64), "cooperative", SplitK("split_k", 4, "cluster"))
    for stages, want in ((3, 4), (5, 4), (7, 6), (8, 8), ("auto", "auto")):
        k = parent.replace(pipeline=dataclasses.replace(parent.pipeline, stages=stages))
        child, _ = apply_action(k, p, Action("splitk", ("split_k", 2, "block")))
        assert child.pipeline.stages == want and child.splitk.reduce == "block", (stages, child.pipeline)
        assert not violations(child), (stages, violations(child))


def test_actions_cover_the_ir_and_diff_round_trips():
    knobs = {a.knob for a in ACTIONS}
    for need in ("block", "warps", "cluster", "stages", "schedule", "persistent", "raster", "group", "smem_swizzle",
                 "splitk", "epilogue_path", "epilogue_vector", "pad", "rules", "backend"):
        assert need in knobs
    p = Problem(4096, 4096, 4096)
    k80, k90 = seed(p, "sm80"), seed(p, "sm90a")
    # A move between the rules changes target, mma and pipeline together, and the edits replay it exactly.
    child, _ = apply_action(k90, p, Action("rules", "sm80"))
    assert (child.target.arch, child.mma.op, child.pipeline.mode) == ("sm80", "mma_sync", "multistage")
    back, _ = apply_action(child, p, Action("rules", "sm90a"))
    assert (back.target.arch, back.mma.op, back.pipeline.mode) == ("sm90a", "wgmma", "tma_ws")
    for parent, kid in ((k90, child), (child, back), (k80, k90)):
        edits = diff_edits(parent, kid)
        assert Proposal(edits=edits).apply(parent, p) == kid
    # Without a Hopper GPU there is no move to the sm90a rule.
    assert apply_action(k80, p, Action("rules", "sm90a"), arch="sm80") is None
    # A wgmma tile change brings its MMA shape along.
    wide, _ = apply_action(k90, p, Action("block", (128, 64, 64)))
    assert wide.mma.shape == (64, 64, 16)


# ---------------------------------------------------------------------------------------------------------------
# Random legal edits.
# ---------------------------------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(problems(max_dim=8192), ARCHS, st.integers(0, 2 ** 20), st.integers(1, 12))
def test_random_proposals_are_legal(problem, arch, s, count):
    parent = seed(problem, arch)
    ctx = Context(problem, parent, seed=s, count=count, arch="sm90a")
    props = RandomEdits(depth=2).propose(ctx)
    _check_proposals(ctx, props)
    assert props, "a seed kernel always has some legal neighbour"


def test_random_is_deterministic_and_seeded():
    p = Problem(1024, 2048, 512)
    ctx = Context(p, seed(p, "sm90a"), seed=7, count=8)
    a = [x.text() for x in RandomEdits().propose(ctx)]
    assert a == [x.text() for x in RandomEdits().propose(ctx)]
    assert a != [x.text() for x in RandomEdits().propose(dataclasses.replace(ctx, seed=8))]


def test_random_reaches_every_knob_and_backend():
    """Over a few problems and seeds the random policy uses every kind of edit, moves kernels between the sm80 and
    sm90a rules in both directions and asks for the non-default backends."""
    notes, backends = set(), set()
    for shape in ((4096, 4096, 4096), (128, 128, 8192), (1000, 1000, 1000), (1000, 1000, 1001)):
        p = Problem(*shape)
        for arch in ("sm90a", "sm80"):
            for s in range(6):
                for prop in RandomEdits().propose(Context(p, seed(p, arch), seed=s, count=16)):
                    notes.add(prop.note.split(": ", 1)[1].split("=")[0])
                    backends.add(prop.backend)
    assert set(KNOBS) - {"align"} <= notes, f"never drawn: {set(KNOBS) - notes}"
    assert {"cuda_ptx", "cuda_ptx_sm80"} <= backends


# ---------------------------------------------------------------------------------------------------------------
# Expert rules.
# ---------------------------------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(problems(max_dim=16384), ARCHS)
def test_rules_proposals_are_legal(problem, arch):
    ctx = Context(problem, seed(problem, arch), count=8)
    _check_proposals(ctx, Rules().propose(ctx))


def _first(props, prefix):
    return next(p for p in props if p.note.startswith(prefix))


def test_rules_tiny_shape_takes_the_sm80_rule_with_few_stages():
    p = Problem(64, 64, 64)
    ctx = Context(p, seed(p, "sm90a"), count=6)
    props = Rules().propose(ctx)
    assert props[0].note.startswith("tiny")
    k = props[0].apply(ctx.parent, p)
    assert k.mma.op == "mma_sync" and k.pipeline.stages <= 3 and k.tile.bm * k.tile.bn <= 64 * 128


def test_rules_skinny_long_k_splits():
    p = Problem(256, 256, 16384)
    ctx = Context(p, seed(p, "sm80"), count=8)
    props = Rules().propose(ctx)
    split = [q for q in props[:2] if q.apply(ctx.parent, p).splitk is not None]
    assert split, [q.note for q in props]
    assert any(q.note.startswith("split") and "stream-K" in q.note for q in props)


def test_rules_rasterize_one_wave_of_64x64_tiles_in_groups():
    """127x4096x4096 on 64x64 tiles is one wave of 2 x 64 tiles: the rules' ping-pong 64x64 candidate walks along N
    in groups of 8 tile rows, so the two blocks that share each B tile run side by side (measured 17.9 -> 14.2 us
    on cuda_ptx, and CUTLASS's ping-pong 64x64 at 13.1 us). A single row of tiles (M <= 64) has nothing to group;
    squarer few-tile grids measured slower with it."""
    from l2ir.policy.rules import raster_for

    p = Problem(127, 4096, 4096)
    ctx = Context(p, seed(p, "sm90a"), count=16, arch="sm90a")
    waves = [q.apply(ctx.parent, p) for q in Rules().propose(ctx) if q.note.startswith("waves: 64x64 pingpong")]
    assert waves, [q.note for q in Rules().propose(ctx)]
    sw = waves[0].swizzle
    assert (sw.raster, sw.group) == ("along_n", 8)
    assert (raster_for(Problem(64, 4096, 4096), 64, 64, 132).group, raster_for(p, 64, 64, 132).group) == (1, 8)
    # squarer few-tile grids, where group 8 measured 2-5% slower, and the unmeasured mirror keep group 1
    for q in (Problem(128, 128, 16384), Problem(512, 512, 2048), Problem(1024, 128, 1024), Problem(4096, 127, 4096)):
        assert raster_for(q, 64, 64, 132).group == 1, q
    many = raster_for(Problem(8192, 8192, 64), 128, 128, 132)          # 4096 tiles: groups of 8, as before
    assert (many.raster, many.group) == ("along_n", 8)


def test_rules_few_tiles_short_k_split_inside_the_block():
    """1024x128x1024 (64 tiles of 64x32, 16 k tiles) gets the block split on cuda_ptx, which lowers it with no
    workspace; a K loop past 16 k tiles, more tiles than SMs, or one k tile does not."""
    from l2ir.backends.registry import lower
    from l2ir.policy.rules import block_split_kernel

    p = Problem(1024, 128, 1024)
    ctx = Context(p, seed(p, "sm90a"), count=16, arch="sm90a")
    props = [q for q in Rules().propose(ctx) if q.note.startswith("block split")]
    assert len(props) == 1 and props[0].backend == "cuda_ptx"
    kernel = props[0].apply(ctx.parent, p)
    assert kernel.splitk == SplitK("split_k", 2, "block") and kernel.tile.block == (64, 32, 64)
    assert lower(kernel, p, "cuda_ptx").workspace_for(*p.shape) == 0
    for q in (Problem(1024, 128, 1088), Problem(8192, 256, 512), Problem(1024, 128, 64)):
        assert block_split_kernel(q, 132) is None, q


def test_rules_odd_k_decode_takes_the_realigned_sm80_kernel_by_name():
    """17x9999x3333 (odd K, 17 rows): the rules propose the cuda_ptx_sm80 decode kernel with realigned loads, by name
    (the default mma.sync backend loads unaligned rows narrowly), and it is the sweep's measured configuration;
    an aligned K or 64 rows of A does not get it."""
    from l2ir.backends.registry import lower
    from l2ir.search.sweeps import load_sweep

    p = Problem(17, 9999, 3333)
    ctx = Context(p, seed(p, "sm90a"), count=16, arch="sm90a")
    props = [q for q in Rules().propose(ctx) if q.note.startswith("decode, odd K:")]   # (not its one-wave form)
    assert len(props) == 1 and props[0].backend == "cuda_ptx_sm80"
    kernel = props[0].apply(ctx.parent, p)
    swept = load_sweep("cuda_ptx_sm80")["ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode"]
    assert kernel.replace(target=swept.target) == swept
    lower(kernel, p, "cuda_ptx_sm80")
    for q in (Problem(17, 9999, 3336), Problem(64, 9999, 3333)):
        qctx = Context(q, seed(q, "sm90a"), count=16, arch="sm90a")
        assert not any(x.note.startswith("decode, odd K") for x in Rules().propose(qctx)), q


def test_rules_hopper_few_tiles_long_k_splits_in_a_cluster():
    """On Hopper, few output tiles and a long K get split-K reduced in a thread-block cluster, which lowers (on
    cuda_ptx, the only backend that lowers it); a shape whose tiles fill the SMs does not."""
    from l2ir.backends.registry import lower

    p = Problem(128, 128, 16384)
    ctx = Context(p, seed(p, "sm90a"), count=8, arch="sm90a")
    props = Rules().propose(ctx)
    cluster = [q for q in props if "thread-block cluster" in q.note]
    assert cluster, [q.note for q in props]
    kernel = cluster[0].apply(ctx.parent, p)
    # named, so that a child that leaves the cluster reduction stays on cuda_ptx
    assert kernel.splitk.reduce == "cluster" and cluster[0].backend == "cuda_ptx"
    assert kernel.splitk.slices in (2, 4, 8, 16)
    assert lower(kernel, p, cluster[0].backend).workspace_for(*p.shape) == 0
    child, backend = apply_action(kernel, p, Action("splitk", None), "sm90a", cluster[0].backend)
    assert child.splitk is None and backend == "cuda_ptx"
    big = Problem(8192, 8192, 8192)
    bctx = Context(big, seed(big, "sm90a"), count=8, arch="sm90a")
    assert not any("thread-block cluster" in q.note for q in Rules().propose(bctx))


def test_rules_skinny_m_long_k_splits_cooperative_128x64_tiles_in_a_cluster():
    """64 < M <= 128 with N and K in the thousands: the rules rank first a cooperative 128x64 tile split in two in a
    cluster (one wave of blocks: 64 tiles x 2 for 127x4096x4096), named for cuda_ptx, lowering with no workspace.
    None where it was not measured to pay: M <= 64 or above 128, more tiles than one wave of 2 slices holds, blocks
    filling less than half the SMs, or a K too short to split."""
    from l2ir.backends.registry import lower

    def coop_split(p):
        # From the CUTLASS stream-K kernel (the sm90a seed outside this rule's shapes): the seed itself is now the
        # rule's kernel where the rule applies, and a parent is never proposed again (below).
        parent = hopper_kernel(p, 128, 128, "cooperative", splitk=SplitK("stream_k"))
        ctx = Context(p, parent, count=12, arch="sm90a")
        props = Rules().propose(ctx)
        hits = [q for q in props if "cooperative tiles of 128x64" in q.note]
        return ctx, props, hits

    for shape in ((127, 4096, 4096), (128, 4096, 16384), (100, 3000, 4104), (65, 2112, 4096), (128, 2112, 4096), (128, 4224, 4096)):
        p = Problem(*shape)
        ctx, props, hits = coop_split(p)
        # First but for the A-multicast kernels (measured faster where they apply: 100x3000x4104, below).
        props = [q for q in props if not q.note.startswith("multicast")]
        assert hits and props[0] is hits[0], (shape, [q.note for q in props])
        kernel = hits[0].apply(ctx.parent, p)
        assert kernel.tile.block == (128, 64, 64) and kernel.pipeline.schedule == "cooperative"
        assert (kernel.splitk.slices, kernel.splitk.reduce, hits[0].backend) == (2, "cluster", "cuda_ptx")
        assert 66 <= 2 * tiles_of(p, 128, 64) <= 132, shape
        assert lower(kernel, p, "cuda_ptx").workspace_for(*p.shape) == 0
    # The seed is the rule's kernel here (l2ir.seed.coop_split_kernel), lowered by cuda_ptx by default; the rules,
    # which name cuda_ptx, must not propose it again as a child of itself.
    p = Problem(127, 4096, 4096)
    parent = seed(p, "sm90a")
    assert parent.tile.block == (128, 64, 64) and parent.splitk.reduce == "cluster"
    props = Rules().propose(Context(p, parent, count=12, arch="sm90a"))
    assert props and all(q.apply(parent, p) != parent for q in props), [q.note for q in props]
    for shape in ((64, 4096, 4096),      # M <= 64: half of every 128-row tile would be padding
                  (256, 2048, 4096),     # M > 128: two rows of tiles
                  (128, 4352, 4096),     # 68 tiles: two slices would be 136 blocks, more than one wave
                  (128, 2048, 4096),     # 32 tiles: 64 blocks fill less than half the SMs
                  (128, 4096, 448),      # 7 k tiles: too short to split
                  (512, 2048, 4096), (8192, 8192, 8192)):
        assert not coop_split(Problem(*shape))[2], shape


def test_rules_skinny_m_long_k_proposes_four_slice_clusters_that_fit_one_wave():
    """Beside the 128x64 split in two, the rules propose cooperative 128xBN tiles split in 4 in a cluster, BN the
    narrowest multiple of 16 (64 to 128) whose four-block clusters fit one wave (27 on an H200): 128x112 at
    100x3000x4104, the tile measured fastest there. The kernel verifies and lowers for cuda_ptx with no workspace.
    None where BN would pass 128, outside 64 < M <= 128, or with a K of fewer than 16 k tiles."""
    from l2ir.backends.registry import lower
    from policy.rules import FOUR_BLOCK_CLUSTER_WAVE, coop_split4_kernel

    def split4(p):
        parent = hopper_kernel(p, 128, 128, "cooperative", splitk=SplitK("stream_k"))
        ctx = Context(p, parent, count=12, arch="sm90a")
        return ctx, [q for q in Rules().propose(ctx) if "split-K 4 in four-block clusters" in q.note]

    for shape, bn in (((100, 3000, 4104), 112), ((100, 3000, 4096), 112), ((128, 1000, 8192), 64),
                      ((65, 2112, 4096), 80), ((128, 3456, 2048), 128)):
        p = Problem(*shape)
        ctx, hits = split4(p)
        assert len(hits) == 1, shape
        kernel = hits[0].apply(ctx.parent, p)
        assert kernel.tile.block == (128, bn, 64) and kernel.mma.shape == (64, bn, 16), (shape, kernel.tile)
        assert (kernel.splitk.slices, kernel.splitk.reduce, hits[0].backend) == (4, "cluster", "cuda_ptx")
        assert tiles_of(p, 128, bn) <= FOUR_BLOCK_CLUSTER_WAVE, shape
        assert lower(kernel, p, "cuda_ptx").workspace_for(*p.shape) == 0
    assert coop_split4_kernel(Problem(100, 3000, 4104), 4) is None     # too few SMs for one four-block cluster
    for shape in ((127, 4096, 4096),     # BN 160: above the 128 the kernel's registers hold
                  (64, 3000, 4104),      # M <= 64: half of every 128-row tile would be padding
                  (256, 3000, 4104),     # two rows of tiles
                  (100, 3000, 960)):     # 15 k tiles: under 4 per slice
        assert not split4(Problem(*shape))[1], shape


def test_rules_odd_k_on_hopper_repacks():
    """An odd K on Hopper: from the sm80 seed the rules' first proposal is the repack kernel for the output size,
    named for cuda_ptx (the backend that lowers the copy), and the other repack tiles follow; the interpreter agrees
    with the reference on the first. An aligned K gets no repack proposal."""
    import numpy as np

    from l2ir.backends.registry import lower
    from l2ir.interp import error_bound, interpret, random_inputs, reference
    from l2ir.seed import repack_tile, seed_sm80

    p = Problem(1023, 1025, 1027)
    ctx = Context(p, seed_sm80(p, "sm90a"), count=8, arch="sm90a")
    props = Rules().propose(ctx)
    assert props[0].note.startswith("repack") and props[0].backend == "cuda_ptx", [q.note for q in props]
    kernel = props[0].apply(ctx.parent, p)
    assert kernel.repack is not None and kernel.tile.block == repack_tile(p) and kernel.epilogue.vector == 1
    assert lower(kernel, p, props[0].backend).workspace_for(*p.shape) > 0
    assert sum(q.note.startswith("repack") for q in props) == 3
    small = Problem(100, 72, 131)
    a, b = random_inputs(small, np.random.default_rng(0))
    c = interpret(kernel, small, a, b).c.astype(np.float64)
    assert np.all(np.abs(c - reference(a, b)) <= error_bound(small, a, b))
    aligned = Problem(1024, 1024, 1024)
    actx = Context(aligned, seed(aligned, "sm90a"), count=8, arch="sm90a")
    assert not any(q.note.startswith("repack") for q in Rules().propose(actx))
    # Skinny M: the copy of B costs more than it saves, so the repack kernels come after the small sm80 tiles.
    skinny = Problem(17, 9999, 3333)
    sprops = Rules().propose(Context(skinny, seed(skinny, "sm90a"), count=8, arch="sm90a"))
    notes = [q.note for q in sprops]
    assert not notes[0].startswith("repack") and any(n.startswith("repack") for n in notes), notes


def test_rules_huge_shape_fills_waves_with_big_cooperative_tiles_and_clusters():
    p = Problem(8192, 8192, 8192)
    ctx = Context(p, seed(p, "sm80"), count=8)
    props = Rules().propose(ctx)
    top = props[0].apply(ctx.parent, p)
    assert props[0].note.startswith("waves")
    assert top.pipeline.schedule == "cooperative" and top.tile.bm * top.tile.bn == 128 * 256
    tiles = ceil_div(p.m, top.tile.bm) * ceil_div(p.n, top.tile.bn)
    assert tiles / (ceil_div(tiles, 132) * 132) > 0.95
    assert any(q.apply(ctx.parent, p).tile.cluster == (2, 1) for q in props)


def test_rules_short_k_takes_pingpong():
    p = Problem(4096, 4096, 256)
    ctx = Context(p, seed(p, "sm80"), count=8)
    first = next(q for q in Rules().propose(ctx) if q.note.startswith("waves"))
    assert first.apply(ctx.parent, p).pipeline.schedule == "pingpong"
    # On a cooperative parent, short K asks for ping-pong on the same tile; long K keeps (or asks for) cooperative.
    coop = hopper_kernel(p, 128, 128, "cooperative")
    kids = [q.apply(coop, p) for q in Rules().propose(Context(p, coop, count=8))]
    assert any(c.pipeline.schedule == "pingpong" and c.tile.block == coop.tile.block for c in kids)
    long_k = Problem(4096, 4096, 8192)
    pingpong = hopper_kernel(long_k, 128, 128, "pingpong")
    props = Rules().propose(Context(long_k, pingpong, count=8))
    sched = [q for q in props if q.note.startswith("schedule")]
    assert sched and sched[0].apply(pingpong, long_k).pipeline.schedule == "cooperative"
    assert not any(q.apply(pingpong, long_k).pipeline.schedule == "pingpong" and q.note.startswith("waves")
                   for q in props)


# ---------------------------------------------------------------------------------------------------------------
# A synthetic reward: a deterministic cost model of an H200-like part, written here so the test owns its target.
# ---------------------------------------------------------------------------------------------------------------

SMS = 132
RATE = 7.5e6      # fp16 FLOP per microsecond per SM at the full wgmma rate
BW = 3.0e6        # HBM bytes per microsecond


def synthetic_speedup(problem, kernel, backend=None):
    m, n, k = problem.shape
    bm, bn, bk = kernel.tile.block
    tma = kernel.pipeline.mode == "tma_ws"
    rate = RATE * (1.0 if tma else 0.6)
    tiles = ceil_div(m, bm) * ceil_div(n, bn)
    ktiles = ceil_div(k, bk)
    inten = min(1.0, (2 * bm * bn / (bm + bn)) / 170.7)
    eff = (0.35 + 0.65 * inten) * (1 - 0.4 ** (resolved_stages(kernel) - 1))
    tile_flops = 2 * bm * bn * bk
    sk, t_red = kernel.splitk, 0.0
    if sk is None:
        waves = ceil_div(tiles, SMS)
        t_main = waves * ktiles * tile_flops / (rate * eff)
    elif sk.mode == "split_k":
        waves = ceil_div(tiles * sk.slices, SMS)
        t_main = waves * ceil_div(ktiles, sk.slices) * tile_flops / (rate * eff)
        t_red = m * n * sk.slices * 4 / BW + (0.5 if sk.reduce == "atomic" else 2.0)
    else:
        waves = ceil_div(tiles, SMS)
        t_main = ceil_div(tiles * ktiles, SMS) * tile_flops / (rate * eff) + 1.0
    epi = {"direct": 1.3, "smem": 1.0, "tma": 0.8}[kernel.epilogue.path] * (8 / kernel.epilogue.vector) ** 0.3
    if kernel.pipeline.schedule == "pingpong":
        epi *= 0.3
    t_epi = waves * bm * bn * 2 / (BW / SMS) * epi
    if kernel.tile.cluster != (1, 1):
        t_main *= 0.95 if tiles >= 2 * SMS else 1.05
    sw = kernel.swizzle
    if sw is not None and tiles >= 2 * SMS and sw.group >= 4:
        t_main *= 0.97
    t_main *= 0.99 ** sum(getattr(kernel.pad, d) == "divisible" for d in "mnk")
    t = (5.0 if tma else 4.0) + t_main + t_epi + t_red
    t_ref = 4.5 + 2 * m * n * k / (SMS * RATE * 0.8) + m * n * 2 / BW
    return t_ref / t


def test_climb_with_rules_beats_the_sm80_seed_on_the_synthetic_model():
    p = Problem(8192, 8192, 8192)
    start = seed(p, "sm80")
    c = climb(Rules(), p, synthetic_speedup, start, budget=12)
    assert c.curve[-1] > 1.5 * synthetic_speedup(p, start)
    assert c.curve == sorted(c.curve)


# ---------------------------------------------------------------------------------------------------------------
# The example policy, and the policies inside the search loop.
# ---------------------------------------------------------------------------------------------------------------


def _example():
    spec = importlib.util.spec_from_file_location("my_policy", ROOT / "examples" / "my_policy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.StagesPolicy()


def test_example_policy_runs():
    pol = get_policy(_example())
    assert len((ROOT / "examples" / "my_policy.py").read_text().split("class StagesPolicy")[1].splitlines()) <= 21
    p = Problem(2048, 2048, 4096)
    ctx = Context(p, seed(p, "sm80"), count=4)
    props = pol.propose(ctx)
    _check_proposals(ctx, props)
    assert {q.apply(ctx.parent, p).pipeline.stages for q in props} == {2, 4, 5}
    c = climb(pol, p, synthetic_speedup, seed(p, "sm80"), budget=8)
    assert len(c.curve) >= 2
    assert isinstance(pol, StatelessPolicy)


@pytest.mark.parametrize("name", ["random", "rules"])
def test_policies_drive_the_search_loop_on_the_standin(name, tmp_path):
    run_in_loop(name, tmp_path)


def run_in_loop(name, tmp_path):
    loop = pytest.importorskip("l2ir.search.loop")
    from l2ir.search.db import RecordsDB
    from l2ir.search.standin import StandinConfig, StandinEvaluator

    cfg = loop.TuneConfig(shapes=((1024, 1024, 2048),), policy=name, budget_candidates=12, batch=4,
                          mode="standin", sweeps=False, retime=False)
    db = RecordsDB(tmp_path / "r.db")
    ev = StandinEvaluator(StandinConfig(("offline",), 0))
    search = loop.Search(cfg, db, ev, policy=get_policy(name))
    states = search.run()
    assert states[0].best is not None
    mine = [e for e in db.edits(search.run_id) if e["policy"] == name]
    assert any(e["verdict"] == "measured" for e in mine), mine
    assert not [e for e in mine if e["verdict"] == "illegal"], "a policy's proposals are legal"
    # Random and learned draw anew at every step and fill the budget; the rules run out of new ideas.
    if name != "rules":
        assert states[0].candidates == 12


def test_fit_backend_keeps_what_cuda_ptx_lowers():
    """Moving a wgmma kernel to cuda_ptx keeps its in-kernel split-K (tree or cluster) and a one-warpgroup ping-pong
    tile (made non-persistent), drops only what the rule does not generate (stream-K, atomics, clusters, the TMA
    store), and the child lowers; the repack action lands on cuda_ptx too."""
    from l2ir.backends.registry import lower
    from l2ir.nodes import Epilogue
    from l2ir.policy.actions import fit_backend

    p = Problem(512, 512, 8192)
    base = seed(Problem(4096, 4096, 4096), "sm90a")            # CUTLASS-style: ping-pong, persistent, TMA store
    for sk, kept in ((SplitK("split_k", 4), True), (SplitK("split_k", 4, "cluster"), True),
                     (SplitK("split_k", 4, "atomic"), False), (SplitK("stream_k"), False), (None, True)):
        k = fit_backend(base.replace(splitk=sk, epilogue=Epilogue("tma", 8)), "cuda_ptx")
        assert k.splitk == (sk if kept else None)
        assert k.pipeline.schedule == "pingpong" and not k.pipeline.persistent and k.tile.cluster == (1, 1)
        assert k.epilogue.path in ("direct", "smem") and lower(k, p, "cuda_ptx").source
    odd = Problem(1000, 1000, 1001)
    child, backend = apply_action(base, odd, Action("repack", "ab"), "sm90a")
    assert child.repack is not None and backend == "cuda_ptx" and lower(child, odd, backend).source
    # From the narrow-load sm80 seed of an odd K, the action crosses to the TMA rule with the copy; on an aligned K
    # it has nothing to copy and does not apply.
    child, backend = apply_action(seed(odd, "sm80"), odd, Action("repack", "ab"), "sm90a")
    assert child.repack is not None and child.mma.op == "wgmma" and lower(child, odd, backend).source
    assert apply_action(base, Problem(1000, 1000, 1000), Action("repack", "ab"), "sm90a") is None


def test_rules_skinny_m_many_n_tiles_propose_a_multicast_along_n():
    """M <= 128, a long K and many N tiles: the rules propose ping-pong 64x64 tiles, one per block, in 1x8 and 1x4
    clusters (TMA multicast of A along N) on CUTLASS (measured 12.9 and 13.8 us at 100x3000x4104 against the
    cluster split-K's 16.7), first, and in 2x4 on cuda_ptx (15.5 us) after the split kernels; each verifies and
    lowers on its backend. None where the clusters overflow a wave (127x4096x4096: 32 four-block clusters against
    30, measured 1.5x slower), fill under half the SMs, M > 128 or K is short."""
    from l2ir.backends.registry import lower

    p = Problem(100, 3000, 4104)
    parent = hopper_kernel(p, 128, 128, "cooperative", splitk=SplitK("stream_k"))
    ctx = Context(p, parent, count=12, arch="sm90a")
    props = Rules().propose(ctx)
    hits = [q for q in props if q.note.startswith("multicast")]
    # CUTLASS is the default backend of a TMA-store kernel (backend None), cuda_ptx is named.
    assert [q.backend for q in hits] == [None, None, "cuda_ptx"] and props[:2] == hits[:2], [q.note for q in props]
    clusters = []
    for q in hits:
        kernel = q.apply(parent, p)
        assert kernel.tile.block == (64, 64, 64) and not kernel.pipeline.persistent
        clusters.append(kernel.tile.cluster)
        assert lower(kernel, p, q.backend).source
    assert clusters == [(1, 8), (1, 4), (2, 4)]
    for shape in ((127, 4096, 4096), (64, 2048, 8192), (256, 3000, 4104), (100, 3000, 960)):
        p = Problem(*shape)
        props = Rules().propose(Context(p, hopper_kernel(p, 128, 128, "cooperative"), count=12, arch="sm90a"))
        assert not [q for q in props if q.note.startswith("multicast")], shape


def test_rules_odd_k_decode_fills_one_wave_with_the_three_stage_ring():
    """Where the 4-stage decode kernel's 4 slices take more than one wave (17x9999x3333: 79 tiles), the rules also
    propose its 3-stage form (two blocks per SM) with the slices that fill one wave, ranked first; it is the
    measured sweep configuration and lowers. At 31x4001x2047 (32 tiles x 4 slices: one wave) they do not."""
    from l2ir.backends.registry import lower
    from l2ir.search.sweeps import load_sweep

    p = Problem(17, 9999, 3333)
    ctx = Context(p, seed(p, "sm90a"), count=16, arch="sm90a")
    props = [q for q in Rules().propose(ctx) if q.note.startswith("decode, odd K")]
    assert [q.note.startswith("decode, odd K, one wave") for q in props] == [True, False]
    kernel = props[0].apply(ctx.parent, p)
    swept = load_sweep("cuda_ptx_sm80")["ptx_sm80_32x128x64_w2x4_s3_splitk3_align1_decode"]
    assert kernel.replace(target=swept.target) == swept
    lower(kernel, p, "cuda_ptx_sm80")
    q = Problem(31, 4001, 2047)
    qctx = Context(q, seed(q, "sm90a"), count=16, arch="sm90a")
    assert not any(x.note.startswith("decode, odd K, one wave") for x in Rules().propose(qctx))


def test_rules_odd_k_decode_takes_the_interleaved_kernel_first():
    """An odd K with up to 64 rows of A: the interleaved decode kernel (columns 8 apart, only A realigned) ranks above
    the realigning ones, by name (cuda_ptx_sm80 is the only backend of the interleave node), with the slices that
    fill about one wave and with 3; the first is the measured sweep configuration at 17x9999x3333 and lowers. 65
    rows of A or an aligned K do not get it."""
    from l2ir.backends.registry import lower
    from l2ir.search.sweeps import load_sweep

    p = Problem(17, 9999, 3333)
    ctx = Context(p, seed(p, "sm90a"), count=16, arch="sm90a")
    props = Rules().propose(ctx)
    odd = [q for q in props if "decode, odd K" in q.note]
    assert odd[0].note.startswith("interleaved decode, odd K") and odd[0].backend == "cuda_ptx_sm80"
    kernel = odd[0].apply(ctx.parent, p)
    swept = load_sweep("cuda_ptx_sm80")["ptx_sm80_32x128x64_w2x4_s4_splitk3_interleave"]
    assert kernel.replace(target=swept.target) == swept
    lower(kernel, p, "cuda_ptx_sm80")
    wide = Problem(16, 8192, 4097)            # 64 tiles: 4 slices fill the wave; 3 proposed after them
    wctx = Context(wide, seed(wide, "sm90a"), count=16, arch="sm90a")
    slices = [q.apply(wctx.parent, wide).splitk.slices for q in Rules().propose(wctx)
              if q.note.startswith("interleaved decode")]
    assert slices == [4, 3]
    for q in (Problem(65, 9999, 3333), Problem(17, 9999, 3336)):
        qctx = Context(q, seed(q, "sm90a"), count=16, arch="sm90a")
        assert not any(x.note.startswith("interleaved decode") for x in Rules().propose(qctx)), q


def test_rules_write_bound_shapes_get_the_tma_store_kernel():
    """K <= 256 with a C of at least 32 MB (8192x4096x128: 64 MB): the cuda_ptx TMA-store kernel, the measured sweep
    configuration, which lowers with the bulk store; a long K or a small C does not get it."""
    from l2ir.backends.registry import lower
    from l2ir.search.sweeps import load_sweep

    p = Problem(8192, 4096, 128)
    ctx = Context(p, seed(p, "sm90a"), count=16, arch="sm90a")
    props = [q for q in Rules().propose(ctx) if q.note.startswith("write-bound")]
    assert len(props) == 1 and props[0].backend == "cuda_ptx"
    kernel = props[0].apply(ctx.parent, p)
    assert kernel == load_sweep("cuda_ptx")["ptx_coop_128x256x64_tma"]
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in lower(kernel, p, "cuda_ptx").source
    for q in (Problem(8192, 4096, 1024), Problem(1024, 1024, 128)):
        qctx = Context(q, seed(q, "sm90a"), count=16, arch="sm90a")
        assert not any(x.note.startswith("write-bound") for x in Rules().propose(qctx)), q
