"""Index functions: bijections on their domains, and the C++ rendering computes what Python evaluates."""

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l2ir.errors import ExprError
from l2ir.indexing import Var, cdiv, eval_launch_expr, rasterize, smem_swizzle, splitk_range


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
    src = f"""#include <algorithm>
#include <cstdio>
using std::min;
int main() {{
  for (int tiles_m = 1; tiles_m <= 9; ++tiles_m) for (int tiles_n = 1; tiles_n <= 9; ++tiles_n)
    for (int pid = 0; pid < tiles_m * tiles_n; ++pid) printf("%d %d\\n", {em.to_cpp()}, {en.to_cpp()});
  for (int offset = 0; offset < 4096; ++offset) printf("%d\\n", {sw.to_cpp()});
  for (int k_tiles = 1; k_tiles <= 100; ++k_tiles) for (int slice = 0; slice < {slices}; ++slice)
    printf("%d %d\\n", {kb.to_cpp()}, {ke.to_cpp()});
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
    assert got[:-1] == want
