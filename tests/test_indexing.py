"""Index functions: bijections on their domains, and the C++ rendering computes what Python evaluates."""

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l2ir.errors import ExprError
from l2ir.indexing import SplitKTree, Var, cdiv, eval_launch_expr, rasterize, smem_swizzle, splitk_range


@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from(["along_m", "along_n"]), st.integers(1, 40))
def test_rasterization_is_a_bijection(tiles_m, tiles_n, order, group):
    em, en = rasterize(order, group)
    pid = np.arange(tiles_m * tiles_n)
    env = {"pid": pid, "tiles_m": tiles_m, "tiles_n": tiles_n}
    tm = np.broadcast_to(em.eval(env), pid.shape)
    tn = np.broadcast_to(en.eval(env), pid.shape)
    assert tm.min() >= 0 and tm.max() < tiles_m and tn.min() >= 0 and tn.max() < tiles_n
    assert len(set(zip(tm.tolist(), tn.tolist()))) == tiles_m * tiles_n


def test_rasterization_orders():
    em, en = rasterize("along_n", 1)
    env = {"tiles_m": 2, "tiles_n": 3}
    assert [(em.eval({**env, "pid": p}), en.eval({**env, "pid": p})) for p in range(6)] == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]          # row-major, N fastest
    em, en = rasterize("along_m", 1)
    assert [(em.eval({**env, "pid": p}), en.eval({**env, "pid": p})) for p in range(6)] == \
        [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]          # column-major, M fastest
    em, en = rasterize("along_n", 2)
    env = {"tiles_m": 3, "tiles_n": 2}
    assert [(em.eval({**env, "pid": p}), en.eval({**env, "pid": p})) for p in range(6)] == \
        [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]          # strips of 2 rows, last strip narrower


@given(st.integers(0, 3), st.integers(0, 4), st.integers(0, 4), st.integers(0, 4))
def test_swizzle_is_a_bijection_on_aligned_blocks(b, m, s, extra):
    e = smem_swizzle(b, m, s)
    size = 1 << (b + m + s + extra)
    out = e.eval({"offset": np.arange(size)})
    if s >= b:
        assert sorted(out.tolist()) == list(range(size))
    else:
        # Overlapping source/target bits: still a map into the block, but the verifier rejects it (S < B).
        assert out.max() < size


@given(st.integers(1, 500), st.integers(1, 64))
def test_splitk_ranges_tile_the_k_loop(k_tiles, slices):
    eb, ee = splitk_range(slices)
    covered = []
    for s in range(slices):
        b, e = eb.eval({"slice": s, "k_tiles": k_tiles}), ee.eval({"slice": s, "k_tiles": k_tiles})
        assert 0 <= b <= e <= k_tiles
        covered.extend(range(b, e))
    assert covered == list(range(k_tiles))


def _run_tree(tree: SplitKTree, partials, arrivals):
    """The split-K tree protocol on one tile, blocks run one after another in `arrivals` order (a legal
    interleaving): returns the root's sum, the slot write counts, the counters after the launch, the root block."""
    slots = [None] * tree.slices
    writes = [0] * tree.slices
    counters = [0] * tree.counters
    root = None
    for s in arrivals:
        acc = partials[s]
        for step in tree.steps(s):
            slots[step.base] = acc
            writes[step.base] += 1
            counters[step.counter] += 1
            assert counters[step.counter] <= 2, ("three arrivals on one pair node", step)
            if counters[step.counter] == 1:
                break
            counters[step.counter] = 0
            acc = acc + slots[step.sibling]
        else:
            assert root is None, "two blocks finished the root"
            root = (s, acc)
    assert root is not None, "no block finished the root"
    return root[1], writes, counters, root[0]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 70), st.randoms(use_true_random=False))
def test_splitk_tree_pairs_every_slice_once(slices, rnd):
    """The tree's pair nodes are numbered 0..slices-2, each met by exactly two subtrees; every slice's path ends at
    the root (base 0) within ceil(log2 slices) levels; in any arrival order exactly one block reaches the root, every
    counter ends at zero and each slot is written slot_writes() times."""
    tree = SplitKTree(slices)
    assert tree.levels == (slices - 1).bit_length() and 2 ** tree.levels >= slices > 2 ** (tree.levels - 1)
    meetings: dict[int, set] = {}
    for s in range(slices):
        path = tree.steps(s)
        assert path and path[-1].merged == 0 and len(path) <= tree.levels
        assert path[0].base == s and all(a.merged == b.base for a, b in zip(path, path[1:]))
        for step in path:
            assert {step.base, step.sibling} == {step.merged, step.merged + (1 << step.level)}
            assert step.base % (1 << step.level) == 0 and step.sibling < slices
            meetings.setdefault(step.counter, set()).add((step.level, step.base))
    assert sorted(meetings) == list(range(tree.counters))
    assert all(len(v) == 2 and len({lv for lv, _ in v}) == 1 for v in meetings.values()), meetings
    if slices & (slices - 1) == 0:
        assert all(len(tree.steps(s)) == tree.levels for s in range(slices))
    order = list(range(slices))
    rnd.shuffle(order)
    _, writes, counters, _ = _run_tree(tree, [float(s) for s in range(slices)], order)
    assert tuple(writes) == tree.slot_writes() and not any(counters)
    assert sum(tree.slot_writes()) == 2 * tree.counters   # two stores per pair node; the root's sum goes to C


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 3, 5, 6, 7, 8, 13, 16, 32]), st.randoms(use_true_random=False))
def test_splitk_tree_sum_has_the_same_bits_in_every_arrival_order(slices, rnd):
    """fp32 partials of very different magnitudes (the order of additions shows in the bits): every arrival order
    gives SplitKTree.reduce's bits, whichever block ends at the root."""
    tree = SplitKTree(slices)
    gen = np.random.default_rng(rnd.randrange(2 ** 32))
    partials = [(gen.standard_normal(64) * 10.0 ** gen.integers(-6, 6, 64)).astype(np.float32)
                for _ in range(slices)]
    want = tree.reduce(partials)
    assert want.dtype == np.float32
    roots = set()
    for _ in range(6):
        order = list(range(slices))
        rnd.shuffle(order)
        got, _, _, root = _run_tree(tree, partials, order)
        roots.add(root)
        assert got.tobytes() == want.tobytes()
    exact = np.sum(np.array(partials, dtype=np.float64), axis=0)
    assert np.all(np.abs(want - exact) <= slices * 2.0 ** -24 * np.sum(np.abs(partials), axis=0) + 1e-30)


def test_splitk_tree_shapes():
    """S=5: slices 0..3 form a full 4-leaf subtree, slice 4 waits at no level until it meets it at the root."""
    tree = SplitKTree(5)
    assert tree.levels == 3 and tree.counters == 4
    assert [(t.level, t.base, t.sibling, t.counter, t.merged) for t in tree.steps(4)] == [(2, 4, 0, 3, 0)]
    assert [(t.level, t.sibling) for t in tree.steps(3)] == [(0, 2), (1, 0), (2, 4)]
    assert tree.slot_writes() == (3, 1, 2, 1, 1)
    assert tree.reduce([1, 2, 4, 8, 16]) == 31
    with pytest.raises(ExprError, match="at least 2"):
        SplitKTree(1)
    with pytest.raises(ExprError, match="outside"):
        tree.steps(5)


def test_launch_expressions():
    assert eval_launch_expr("cdiv(n, 128) * 2 + min(m, 3)", 7, 300, 1) == 9
    assert eval_launch_expr(cdiv(Var("m"), 64), 65, 1, 1) == 2
    with pytest.raises(ExprError, match="only m, n, k are bound"):
        eval_launch_expr("tiles + 1", 1, 1, 1)
    with pytest.raises(ExprError, match="division by zero"):
        eval_launch_expr("m / (n - n)", 1, 1, 1)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@settings(max_examples=5, deadline=None)
@given(st.sampled_from(["along_m", "along_n"]), st.integers(1, 9), st.integers(1, 3), st.integers(1, 64))
def test_cpp_rendering_matches_python(tmp_path_factory, order, group, b, slices):
    """Compile the rendered expressions with g++ and compare every value with the Python evaluation."""
    em, en = rasterize(order, group)
    sw = smem_swizzle(b, 3, 3)
    kb, ke = splitk_range(slices)
    tree = SplitKTree(max(slices, 2))
    src = f"""#include <algorithm>
#include <cstdio>
using std::min;
int main() {{
  for (int tiles_m = 1; tiles_m <= 9; ++tiles_m) for (int tiles_n = 1; tiles_n <= 9; ++tiles_n)
    for (int pid = 0; pid < tiles_m * tiles_n; ++pid) printf("%d %d\\n", {em.to_cpp()}, {en.to_cpp()});
  for (int offset = 0; offset < 4096; ++offset) printf("%d\\n", {sw.to_cpp()});
  for (int k_tiles = 1; k_tiles <= 100; ++k_tiles) for (int slice = 0; slice < {slices}; ++slice)
    printf("%d %d\\n", {kb.to_cpp()}, {ke.to_cpp()});
  for (int level = 0; level < {tree.levels}; ++level) for (int base = 0; base < {tree.slices}; ++base)
    printf("%d %d %d\\n", {tree.sibling.to_cpp()}, {tree.merged.to_cpp()}, {tree.counter.to_cpp()});
}}
"""
    d = tmp_path_factory.mktemp("cpp")
    (d / "t.cpp").write_text(src)
    subprocess.run(["g++", "-O1", "-o", str(d / "t"), str(d / "t.cpp")], check=True)
    got = subprocess.run([str(d / "t")], check=True, capture_output=True, text=True).stdout.split("\n")
    want = []
    for tiles_m in range(1, 10):
        for tiles_n in range(1, 10):
            for pid in range(tiles_m * tiles_n):
                env = {"pid": pid, "tiles_m": tiles_m, "tiles_n": tiles_n}
                want.append(f"{em.eval(env)} {en.eval(env)}")
    want += [str(sw.eval({"offset": o})) for o in range(4096)]
    for k_tiles in range(1, 101):
        for s in range(slices):
            env = {"slice": s, "k_tiles": k_tiles}
            want.append(f"{kb.eval(env)} {ke.eval(env)}")
    for level in range(tree.levels):
        for base in range(tree.slices):
            env = {"level": level, "base": base}
            want.append(f"{tree.sibling.eval(env)} {tree.merged.eval(env)} {tree.counter.eval(env)}")
    assert got[:-1] == want


def test_block_split_positions_are_the_producers_order():
    """reduce=block: for every k-tile count, the producer's ring positions (BlockSplit.k_tile) load every k tile
    once, and each consumer's position of its step-th tile (BlockSplit.position), both the expressions the backend
    renders, is where the producer put that tile."""
    from l2ir.indexing import BlockSplit, splitk_range

    begin, end = splitk_range(2)
    for k_tiles in range(1, 300):
        loads = [int(BlockSplit.k_tile().eval({"position": p, "k_tiles": k_tiles})) for p in range(k_tiles)]
        assert sorted(loads) == list(range(k_tiles)), k_tiles
        for s in range(2):
            kb, ke = (int(e.eval({"slice": s, "k_tiles": k_tiles})) for e in (begin, end))
            for j in range(ke - kb):
                p = int(BlockSplit.position().eval({"step": j, "slice": s, "k_tiles": k_tiles}))
                assert p < k_tiles and loads[p] == kb + j, (k_tiles, s, j)


CLUSTERS = [(cm, cn) for cm in (1, 2, 4, 8) for cn in (1, 2, 4, 8) if cm * cn <= 8 and cm * cn > 1]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CLUSTERS), st.integers(1, 13), st.integers(1, 13), st.sampled_from(["along_m", "along_n"]),
       st.sampled_from([1, 2, 3, 8]))
def test_cluster_multicast_covers_every_tile_and_row_once(cluster, tiles_m, tiles_n, order, group):
    """ClusterMulticast: the whole clusters' blocks cover every output tile once (the rest lie past the grid);
    within a cluster each block's A stage gets every row once, from blocks of its own tile row (same tile_m), and
    its B stage likewise from its tile column; a block releases exactly the blocks that fill it, so each empty
    barrier counts release_arrivals per phase."""
    from l2ir.indexing import ClusterMulticast

    mc = ClusterMulticast(*cluster)
    bm, bn = 64 * mc.cn, 8 * mc.cm * 3
    em, en = mc.tile(order, group)
    blocks = mc.size * mc.clusters().eval({"tiles_m": tiles_m, "tiles_n": tiles_n})
    pid = np.arange(blocks)
    env = {"pid": pid, "tiles_m": tiles_m, "tiles_n": tiles_n}
    tm, tn = np.broadcast_to(em.eval(env), pid.shape), np.broadcast_to(en.eval(env), pid.shape)
    inside = (tm < tiles_m) & (tn < tiles_n)
    hits = np.zeros((tiles_m, tiles_n), int)
    np.add.at(hits, (tm[inside], tn[inside]), 1)
    assert (hits == 1).all()
    rank = {"rank": np.arange(mc.size)}
    a0, b0 = mc.a_first(bm).eval(rank), mc.b_first(bn).eval(rank)
    am, bmask, rel = mc.a_mask().eval(rank), mc.b_mask().eval(rank), mc.release_mask().eval(rank)
    for first in range(0, blocks, mc.size):
        ctm, ctn = tm[first:first + mc.size], tn[first:first + mc.size]
        for dst in range(mc.size):
            got_a, got_b, fillers = np.zeros(bm, int), np.zeros(bn, int), set()
            for src in range(mc.size):
                if am[src] >> dst & 1:
                    assert ctm[src] == ctm[dst]
                    got_a[a0[src]:a0[src] + mc.a_rows(bm)] += 1
                    fillers.add(src)
                if bmask[src] >> dst & 1:
                    assert ctn[src] == ctn[dst]
                    got_b[b0[src]:b0[src] + mc.b_rows(bn)] += 1
                    fillers.add(src)
            assert (got_a == 1).all() and (got_b == 1).all()
            assert fillers == {src for src in range(mc.size) if rel[dst] >> src & 1}
            assert len(fillers) * 4 == mc.release_arrivals(4)


def test_cluster_multicast_cpp_matches_python(tmp_path):
    """The rendered tile map and masks give the values the interpreter uses."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    from l2ir.indexing import ClusterMulticast

    mc = ClusterMulticast(2, 4)
    em, en = mc.tile("along_n", 8)
    exprs = (em, en, mc.a_first(64), mc.b_first(64), mc.a_mask(), mc.b_mask(), mc.release_mask())
    src = ("#include <algorithm>\n#include <cstdio>\nusing std::min;\nint main() {\n"
           "  for (int tiles_m = 1; tiles_m <= 5; ++tiles_m) for (int tiles_n = 1; tiles_n <= 9; ++tiles_n)\n"
           f"    for (int pid = 0; pid < 8 * {mc.clusters().to_cpp()}; ++pid) {{ const int rank = pid % 8;\n"
           "      printf(\"" + " ".join(["%d"] * len(exprs)) + "\\n\", "
           + ", ".join(e.to_cpp() for e in exprs) + "); }\n}\n")
    (tmp_path / "t.cpp").write_text(src)
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "t"), str(tmp_path / "t.cpp")], check=True)
    got = subprocess.run([str(tmp_path / "t")], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]
    want = []
    for tiles_m in range(1, 6):
        for tiles_n in range(1, 10):
            for pid in range(8 * mc.clusters().eval({"tiles_m": tiles_m, "tiles_n": tiles_n})):
                env = {"pid": pid, "tiles_m": tiles_m, "tiles_n": tiles_n, "rank": pid % 8}
                want.append(" ".join(str(int(e.eval(env))) for e in exprs))
    assert got == want
