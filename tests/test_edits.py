"""Edits: golden before/after per edit kind, round trips of edit lists, and 'verified result or typed error'."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from l2ir.edits import InsertNode, RemoveNode, ReplaceNode, SetField, apply_edit, apply_edits, parse_edits, print_edits
from l2ir.errors import EditError, L2IRError, ParseError, ResourceError, TargetError
from l2ir.nodes import Mma, SplitK
from l2ir.testing import edits, kernels
from l2ir.text import parse_kernel, print_kernel
from l2ir.verify import verify

BEFORE = """kernel {
  target arch=sm80
  tile block=128x128x32 warps=2x2 cluster=1x1
  mma op=mma_sync shape=16x8x16
  pipeline mode=multistage stages=4 schedule=none prefetch=true persistent=false
  pad m=predicate n=predicate k=zero_fill align=8
  epilogue path=smem vector=8
}
"""

GOLDEN = [
    ("set pipeline.stages = 3",
     BEFORE.replace("stages=4", "stages=3")),
    ("set tile.warps = 2x4\nset tile.block = 128x256x32",
     BEFORE.replace("block=128x128x32 warps=2x2", "block=128x256x32 warps=2x4")),
    ("set swizzle.smem = <2,3,3>",   # an absent swizzle behaves as its defaults, so `set` starts from them
     BEFORE.replace("  pad ", "  swizzle smem=<2,3,3> raster=along_n group=1\n  pad ")),
    ("replace epilogue with epilogue path=direct vector=4",
     BEFORE.replace("path=smem vector=8", "path=direct vector=4")),
    ("insert splitk mode=split_k slices=4 reduce=workspace",
     BEFORE.replace("  epilogue", "  splitk mode=split_k slices=4 reduce=workspace\n  epilogue")),
    ("insert swizzle smem=none raster=along_m group=8; remove swizzle",
     BEFORE),
    ("replace target with target arch=sm90a; replace mma with mma op=mma_sync shape=16x8x8",
     BEFORE.replace("arch=sm80", "arch=sm90a").replace("16x8x16", "16x8x8")),
]


@pytest.mark.parametrize("edits,after", GOLDEN, ids=[g[0].split()[0] + str(i) for i, g in enumerate(GOLDEN)])
def test_golden_edits(edits, after):
    result = apply_edits(parse_kernel(BEFORE), parse_edits(edits))
    assert print_kernel(result) == after


def test_edit_records_print_and_parse_back():
    edits = [SetField("pipeline", "stages", 5), ReplaceNode(Mma("mma_sync", (16, 8, 8))),
             InsertNode(SplitK("split_k", 2)), RemoveNode("splitk"), SetField("swizzle", "smem", (2, 3, 3)),
             SetField("pipeline", "stages", "auto")]
    text = print_edits(edits)
    assert text.splitlines()[0] == "set pipeline.stages = 5"
    assert parse_edits(text) == edits
    assert print_edits(parse_edits(text)) == text


@pytest.mark.parametrize("edit,cls,text", [
    ("set tile.blocks = 1x1x1", ParseError, "tile has no field 'blocks'"),
    ("set tiles.block = 1x1x1", ParseError, "unknown node 'tiles'"),
    ("set pipeline.stages = fast", ParseError, "expected 'auto' or an integer"),
    ("replace mma with tile block=64x64x32 warps=2x2", ParseError, "the new node must be a mma"),
    ("insert pad", EditError, "already has a pad node"),
    ("remove splitk", EditError, "no splitk node to remove"),
    ("remove target", EditError, "cannot be removed"),
    ("set splitk.slices = 4", EditError, "use 'insert splitk ...'"),
    ("set pipeline.stages = 13", ResourceError, "sm80 allows 163 KB"),
    ("set target.arch = sm80\nreplace mma with mma op=wgmma shape=64x128x16", TargetError, "wgmma needs target sm90a"),
])
def test_bad_edits_raise_typed_errors(edit, cls, text):
    with pytest.raises(cls) as info:
        apply_edits(parse_kernel(BEFORE), parse_edits(edit))
    assert text in str(info.value)


def test_edit_parse_errors_are_located():
    with pytest.raises(ParseError) as info:
        parse_edits("set pipeline.stages = 3\nset tile.block 64x64x32", "edits.txt")
    assert (info.value.line, info.value.column) == (2, 16)
    assert str(info.value).startswith("edits.txt:2:16: unexpected '64x64x32'")


@given(kernels(), st.lists(edits(), min_size=1, max_size=3))
def test_edits_give_verified_kernels_or_raise(kernel, edits):
    current = kernel
    for e in edits:
        try:
            current = apply_edit(current, e)
        except L2IRError:
            continue          # a rejected edit leaves the previous kernel in place
        assert verify(current) is current
        assert parse_kernel(print_kernel(current)) == current
    # Replaying the printed record gives the same kernel.
    ok = []
    replay = kernel
    for e in edits:
        try:
            replay = apply_edit(replay, e)
            ok.append(e)
        except L2IRError:
            pass
    assert apply_edits(kernel, parse_edits(print_edits(ok))) == replay == current
