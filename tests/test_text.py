"""Printer and parser together: exact round trips and located errors."""

import glob
import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from l2ir.errors import ParseError
from l2ir.indexing import Bin, Call, Const, Var
from l2ir.nodes import Kernel, Source, Target
from l2ir.text import parse_expr, parse_kernel, parse_kernel_file, parse_problem, print_kernel, print_problem
from l2ir.testing import kernels, problems

HERE = os.path.dirname(__file__)


@given(kernels())
def test_kernel_round_trip(kernel):
    text = print_kernel(kernel)
    again = parse_kernel(text)
    assert again == kernel
    assert print_kernel(again) == text
    assert again.content_hash() == kernel.content_hash()


@given(problems())
def test_problem_round_trip(problem):
    text = print_problem(problem)
    assert parse_problem(text) == problem
    assert print_problem(parse_problem(text)) == text


exprs = st.recursive(
    st.one_of(st.integers(0, 1000).map(Const), st.sampled_from(["m", "n", "k"]).map(Var)),
    lambda inner: st.one_of(
        st.builds(Bin, st.sampled_from(["+", "-", "*", "/", "%", "^", "&", "<<", ">>"]), inner, inner),
        st.builds(lambda f, a, b: Call(f, (a, b)), st.sampled_from(["min", "max", "cdiv"]), inner, inner)),
    max_leaves=8)


@given(exprs)
def test_expression_round_trip(e):
    assert parse_expr(str(e)) == e


@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r`"), max_size=200))
def test_source_code_round_trip(body):
    code = body + '\nextern "C" __global__ void k(const void* A) {}'
    kernel = Kernel(target=Target("sm80"),
                    source=Source("k", (Const(1), Var("m"), Const(1)), (32, 1, 1), 0, code))
    assert parse_kernel(print_kernel(kernel)) == kernel


def test_canonical_text_is_fixed_point():
    for path in glob.glob(os.path.join(HERE, "..", "examples", "*.l2")):
        _, kernel, _ = parse_kernel_file(open(path).read(), path)
        text = print_kernel(kernel)
        assert print_kernel(parse_kernel(text)) == text


def test_content_hash_is_stable_and_structural():
    a = parse_kernel("kernel {\n target arch=sm80\n tile block=64x64x32 warps=2x2\n}")
    b = parse_kernel("kernel { target arch=sm80; tile   block=64x64x32 warps=2x2 cluster=1x1 }")
    assert a == b and hash(a) == hash(b)
    # The hash is of the canonical text, so it is the same in every process and on every machine.
    # Golden value: a change here means every cache key and records-DB hash changes too.
    assert a.content_hash() == "37d9dcc07ba53f4dc29eb64d9389d9e781bfecebf4de1f7d9033c01a38b59990"
    assert a.content_hash() != parse_kernel("kernel { target arch=sm80; tile block=64x64x64 warps=2x2 }").content_hash()


def _invalid_cases():
    for path in sorted(glob.glob(os.path.join(HERE, "invalid", "*.l2"))):
        text = open(path).read()
        want = re.search(r"^# ERROR: (.*)$", text, re.M).group(1)
        at = re.search(r"^# AT: (\d+):(\d+)$", text, re.M)
        yield pytest.param(text, want, (int(at.group(1)), int(at.group(2))) if at else None,
                           id=os.path.basename(path))


@pytest.mark.parametrize("text,want,at", list(_invalid_cases()))
def test_invalid_files_report_located_errors(text, want, at):
    with pytest.raises(ParseError) as info:
        parse_kernel_file(text, "bad.l2")
    err = info.value
    assert want in err.message, err.message
    if at is not None:
        assert (err.line, err.column) == at
    assert str(err).startswith(f"bad.l2:{err.line}:")


def test_crlf_files_and_tagged_fences_parse_like_plain_ones():
    text = open(os.path.join(HERE, "..", "examples", "source_naive.l2")).read()
    kernel = parse_kernel(text)
    assert parse_kernel(text.replace("\n", "\r\n")) == kernel
    # LLM replies tag their fences: ```cuda opens a code block like ``` does.
    assert parse_kernel(text.replace("code=```", "code=```cuda")) == kernel


def test_values_that_cannot_be_printed_are_rejected_at_construction():
    from l2ir.errors import ExprError
    from l2ir.nodes import Tile

    with pytest.raises(ParseError, match="line starting with ```"):
        Source("k", (Const(1),) * 3, (32, 1, 1), 0, '__global__ void k() {}\n```\n')
    with pytest.raises(ParseError, match="expected dims"):
        Tile(block=(64, 64, 32), warps=(True, 2))
    with pytest.raises(ExprError, match="non-negative constants"):
        Var("m") + (-1)


@pytest.mark.parametrize("expr,message", [("1 << (m - 2)", "negative value"), ("(m - 6) / 4", "negative value"),
                                          ("1 << 100", "more than 62 bits")])
def test_index_expressions_refuse_what_cpp_would_compute_differently(expr, message):
    from l2ir.errors import ExprError

    with pytest.raises(ExprError, match=message):
        parse_expr(expr).eval({"m": 1})
