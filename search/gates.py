"""Correctness gates: the arithmetic of each check, independent of how the kernel is launched.

Each gate is a recorded verdict (name, passed, detail). The evaluator runs them on the GPU with torch tensors; every
function here also runs on CPU tensors, which is how the bounds themselves are tested.

The gates (the README's gate table says what each costs):
- accuracy:        fresh randn inputs (new seed each call) vs a float64 reference, by ||C - ref||_F / ||ref||_F,
                   bound from the output rounding plus the accumulator's error growth over K (`tolerance`), and
                   per element (`element_violations`).
- ulp:             the same output in ulps of the correctly rounded result (`check_ulps`): an fp32 accumulator is
                   within one almost everywhere, fp16 partial sums are not, whatever their magnitude.
- all_written:     C poisoned with a NaN bit pattern before the run; every element must have been overwritten.
- guard_bands:     every buffer sits between two guard regions filled with a known byte pattern, checked after.
- stale_output:    a second call with fresh inputs into the same C must give the new product (no cached result).
- partial_refresh: a few random rows of A (then columns of B) refreshed in place, C kept, one call: every row must
                   be the new product (a kernel that recognises inputs by a few sampled values leaves stale rows).
- ragged_shapes:   the same checks on shapes that no tile divides (`ragged_shapes`), where the kernel allows them.
- timed_outputs:   every output set written by the timed calls, on inputs re-randomised and outputs poisoned before
                   each trial or round, passes the ulp check against the float64 product of its inputs, and the
                   inputs come back unchanged (search/timing.py, search/evaluator.py).
- replay_gain:     per-call time in a replay vs a single call on fresh inputs, and vs a replay that meets every set
                   once, each against the baseline's ratio (a kernel that skips repeated calls is faster in a replay).
- post_timing:     after timing, fresh inputs and poison, one call, checked against float64 (a launch counter).
- repeated_calls:  the post_timing inputs again, C poisoned before each of many calls (a time budget's worth), every
                   output equal bit for bit to the checked one where the schedule sums in a fixed order
                   (`reproducible`), else within the ulp count of the float64 product (a rare race).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from l2ir.errors import VerifyError
from l2ir.nodes import Kernel, Problem
from l2ir.target import UNIT_ROUNDOFF

GATES = ("accuracy", "ulp", "all_written", "stale_output", "partial_refresh", "guard_bands", "ragged_shapes")
TIMING_GATES = ("timed_outputs", "replay_gain", "post_timing", "repeated_calls")


@dataclass(frozen=True)
class Verdict:
    name: str
    passed: bool
    detail: str = ""
    skipped: bool = False     # the gate does not apply (passed is then True); detail says why

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Verdict":
        return Verdict(**d)


# ---------------------------------------------------------------------------------------------------------------
# Error bounds.
# ---------------------------------------------------------------------------------------------------------------

# Accumulation error of a K-long dot product of randn terms grows like u * sqrt(K/2) when rounding errors are
# independent (the partial sums have size sqrt(k)). Tensor cores truncate rather than round inside their adders,
# which biases the errors, so the bound carries a generous factor; for fp32 accumulators the term stays far below
# the fp16 output rounding anyway (8 * 2^-24 * sqrt(16384) = 6e-5 against 4.9e-4).
ACC_SAFETY = 8.0


def tolerance(k: int, acc: str, out: str) -> float:
    """Bound on ||C - ref||_F / ||ref||_F for a correct kernel: output rounding (each element within u_out of its
    exact value, so the Frobenius norm too) plus the accumulator's growth over K."""
    return UNIT_ROUNDOFF[out] + ACC_SAFETY * UNIT_ROUNDOFF[acc] * math.sqrt(k)


def relative_error(c, ref) -> float:
    """||C - ref||_F / ||ref||_F in float64 (torch tensors on any device). NaN/Inf in C give inf."""
    import torch

    c64 = c.to(torch.float64)
    if not bool(torch.isfinite(c64).all()):
        return math.inf
    den = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(c64 - ref))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def worst_element(c, ref) -> str:
    """Where the largest error is, for the verdict detail."""
    import torch

    diff = (c.to(torch.float64) - ref).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    idx = int(torch.argmax(diff))
    i, j = divmod(idx, ref.shape[1])
    return f"worst at C[{i},{j}] = {float(c[i, j]):.6g}, expected {float(ref[i, j]):.6g}"


# Per-element check: a correct element is within a few output roundings of its exact value, plus the accumulation
# noise on the scale of the whole output. A Frobenius bound alone lets a handful of wrong elements (a skipped
# vector store, one bad row) hide in a large matrix; this one does not.
ELEMENT_SAFETY = 4.0


def element_violations(c, ref, k: int, acc: str, out: str) -> int:
    """How many elements break |C - ref| <= 4 u_out |ref| + 4 tol(K) rms(ref)."""
    import torch

    c64 = c.to(torch.float64)
    rms = float(torch.sqrt(torch.mean(ref * ref))) if ref.numel() else 0.0
    bound = ELEMENT_SAFETY * UNIT_ROUNDOFF[out] * ref.abs() + ELEMENT_SAFETY * tolerance(k, acc, out) * rms
    bad = ~((c64 - ref).abs() <= bound)          # NaN compares false, so it counts as a violation
    return int(bad.sum())


def check_accuracy(name: str, c, ref, k: int, acc: str, out: str, note: str = "") -> Verdict:
    err = relative_error(c, ref)
    tol = tolerance(k, acc, out)
    detail = f"rel err {err:.3e} (bound {tol:.3e}, K={k}, acc={acc}, out={out})" + (f"; {note}" if note else "")
    bad_elements = element_violations(c, ref, k, acc, out) if err <= tol else None
    if err <= tol and bad_elements == 0:
        return Verdict(name, True, detail)
    import torch

    bad = int((~torch.isfinite(c.to(torch.float32))).sum())
    extra = f"; {bad} non-finite elements" if bad else ""
    if bad_elements:
        extra += f"; {bad_elements} element(s) outside the per-element bound"
    return Verdict(name, False, detail + extra + "; " + worst_element(c, ref))


def wrong_lines(c, ref, k, acc, out, rows: bool) -> str:
    """Which rows (columns) of C disagree with the reference, for the verdict detail."""
    import torch

    c64 = c.to(torch.float64)
    rms = float(torch.sqrt(torch.mean(ref * ref)))
    bound = ELEMENT_SAFETY * UNIT_ROUNDOFF[out] * ref.abs() + ELEMENT_SAFETY * tolerance(k, acc, out) * rms
    wrong = (~((c64 - ref).abs() <= bound)).any(dim=1 if rows else 0)
    idx = torch.nonzero(wrong).flatten().tolist()
    kind = "rows" if rows else "columns"
    return f"{len(idx)} {kind} wrong ({', '.join(map(str, idx[:6]))}{', ...' if len(idx) > 6 else ''})"


# ---------------------------------------------------------------------------------------------------------------
# Ulps against the correctly rounded result.
# ---------------------------------------------------------------------------------------------------------------
#
# A magnitude bound (Frobenius or per element) can be gamed: fp16 partial sums promoted to fp32 every few k-steps
# stay under it on random data. Counting ulps cannot. Let s be an element's exact value, r = round_out(s) the
# correctly rounded output, s' the kernel's accumulator (error e = s' - s) and c = round_out(s') its output.
#
# * Where |e| is far below ulp_out(s), c = r except when s lies within |e| of a rounding midpoint, and then c is
#   r's neighbour: one ulp. Two ulps need |e| >= one ulp (both roundings are at most half an ulp).
# * fp32 accumulation error of one element, honest kernels, randn inputs (product rms sigma, partial sums of k
#   terms have rms sigma*sqrt(k)):
#     - round to nearest after every product (a scalar fma loop), or after groups (blocked, split-K partials
#       reduced in fp32, cuBLAS): errors independent, each within u*|partial|, so
#       var(e) <= sum_k u^2/3 * k sigma^2 = u^2 sigma^2 K^2 / 6,          std <= u sigma K / sqrt(6);
#     - tensor cores (A100/H100) sum a group of g >= 8 products and truncate toward zero into the fp32 accumulator
#       (Fasi, Higham, Mikaitis, Pranesh 2021). Truncation is biased (mean -u*P_j for partial P_j), so
#       e ~ -u sum_j P_{gj}, a sum of K/g correlated partials:                std ~ u sigma K^1.5 / (g sqrt(3)).
#   ACC_NOISE(K) = u_acc * sigma * (K / sqrt(6) + K^1.5 / (8 sqrt(3))) bounds both (g = 8); numpy simulations of
#   sequential, blocked, split-K and truncating accumulation from K = 16 to 16384 stay below it
#   (tests/test_evaluator_cpu.py). At K = 16384 it is 9.4e-3 sigma, against an fp16 ulp of 6.3e-2 at |s| = 128.
# * Near s = 0 the output ulp shrinks while e does not, so ulps are counted in units of
#   max(ulp_out(r), ULP_FLOOR_Z * ACC_NOISE): d = |c - r| / max(ulp_out(r), U). Then d > 1 needs |e| > U/2 =
#   6 ACC_NOISE (probability < 1e-8 for a Gaussian e) and d > 2 needs |e| > U = 12 ACC_NOISE (never).
# * The verdict: no element beyond 2 (NaN or Inf anywhere is a failure), and at most ULP_FRACTION of the elements
#   beyond 1. An fp16 accumulator, even one that rounds only each 16-product MMA result to fp16 before adding it in
#   fp32, has errors of u_16 * sigma * sqrt(16 K / 3), which is 2.7x U/2 at K = 16384 and far more below it:
#   tens of percent of its elements are beyond one unit at every K >= 32 (at K = 16 the one group is the whole
#   sum, so its single fp16 rounding is the correct rounding and there is nothing to catch).
# The separate precision probe (inputs with cancelling +-1024 products) is dropped: the ulp gate rejects every fp16
# accumulation pattern it caught, on ordinary randn inputs that a kernel cannot tell apart from the timed ones.

ULP_FLOOR_Z = 12.0
ULP_FRACTION = 1e-4
_SIGNIFICAND_BITS = {"f16": 10, "bf16": 7, "f32": 23}     # stored fraction bits: ulp(x) = 2^(floor(log2|x|) - p)
_MIN_EXPONENT = {"f16": -14, "bf16": -126, "f32": -126}   # below it the ulp is the subnormal spacing


def acc_noise(k: int, acc: str, sigma: float) -> float:
    """One-standard-deviation-or-more scale of an honest accumulator's error on one output element (see above)."""
    return UNIT_ROUNDOFF[acc] * sigma * (k / math.sqrt(6.0) + k ** 1.5 / (8.0 * math.sqrt(3.0)))


def ulp_out(x, out: str):
    """ulp of the output format at |x| (float64 tensor), subnormals included."""
    import torch

    _, exp = torch.frexp(x.abs())                  # |x| = m 2^exp, m in [0.5, 1): floor(log2|x|) = exp - 1
    e = torch.clamp(exp - 1, min=_MIN_EXPONENT[out])
    return torch.ldexp(torch.ones_like(x), e - _SIGNIFICAND_BITS[out])


def round_out(ref, out: str):
    """ref (float64) correctly rounded to the output format, as float64. Not `ref.to(float16)`: torch converts a
    double to a half through float, and that double rounding is off by one ulp for about 1 element in 8000."""
    import torch

    unit = ulp_out(ref, out)
    return torch.round(ref / unit) * unit          # an exact scaling by a power of two, ties to even


def ulp_distance(c, ref, k: int, acc: str, out: str):
    """Per element: |c - round_out(ref)| in units of max(ulp_out, U). NaN where c is not finite."""
    import torch

    r = round_out(ref, out)
    c64 = c.to(torch.float64)
    # sigma stays a 0-d tensor: the timed-output checks queue this on the device without a host sync.
    sigma = torch.sqrt(torch.mean(ref * ref)) / math.sqrt(max(k, 1)) if ref.numel() else ref.new_zeros(())
    unit = torch.maximum(ulp_out(r, out), ULP_FLOOR_Z * acc_noise(k, acc, sigma))
    d = (c64 - r).abs() / unit
    return torch.where(torch.isfinite(c64), d, torch.full_like(d, math.nan))


def ulp_excess(c, ref, k: int, acc: str, out: str):
    """check_ulps' two counts as 0-d tensors (no host sync): elements beyond 1 unit and beyond 2 units of the
    correctly rounded `ref`, each counting the non-finite elements too."""
    return _beyond(ulp_distance(c, ref, k, acc, out))


def _beyond(d):
    """Elements of ulp distances `d` beyond 1 unit and beyond 2 units, non-finite ones counted in both (0-d
    tensors): the one count that check_ulps and ulp_excess both apply."""
    import torch

    nan = torch.isnan(d)
    return ((d > 1) | nan).sum(), ((d > 2) | nan).sum()


def ulp_allowed(numel: int) -> int:
    """How many elements check_ulps lets lie beyond 1 unit (none may lie beyond 2)."""
    return int(ULP_FRACTION * numel)


def reproducible(kernel: Kernel) -> bool:
    """Whether equal inputs must give bitwise equal outputs. Every lowering of a schedule sums in a fixed order (the
    split-K slices too: a workspace turnstile, a cluster's or a block's fixed reduction) except splitk reduce=atomic,
    whose fp32 atomics add the slices in whatever order they finish; free-form Source promises nothing."""
    return kernel.source is None and (kernel.splitk is None or kernel.splitk.reduce != "atomic")


def check_ulps(name: str, c, ref, k: int, acc: str, out: str) -> Verdict:
    """No element beyond 2 units, at most ULP_FRACTION of them beyond 1, nothing non-finite."""
    import torch

    d = ulp_distance(c, ref, k, acc, out)
    nan = int(torch.isnan(d).sum())
    over1, over2 = (int(x) for x in _beyond(d))
    allowed = ulp_allowed(d.numel())
    worst = float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0
    detail = (f"{over1} of {d.numel()} elements beyond 1 ulp (allowed {allowed}), {over2} beyond 2 (allowed 0), "
              f"worst {worst:.3g} ulp (K={k}, acc={acc}, out={out})")
    if nan:
        detail += f"; {nan} non-finite elements"
    passed = over2 == 0 and over1 <= allowed
    if not passed:
        idx = int(torch.argmax(torch.nan_to_num(d, nan=math.inf)))
        i, j = divmod(idx, ref.shape[1])
        detail += (f"; worst at C[{i},{j}] = {float(c[i, j]):.6g}, correctly rounded "
                   f"{float(round_out(ref[i:i + 1, j:j + 1], out)):.6g}")
    return Verdict(name, passed, detail)

# ---------------------------------------------------------------------------------------------------------------
# Poison and guard bands.
# ---------------------------------------------------------------------------------------------------------------

# NaN bit patterns with a distinctive payload. A kernel writing a float never produces this exact pattern by
# accident; checking bits (not isnan) also catches a kernel that writes nothing yet leaves "some" NaN behind.
POISON_BITS = {"f16": 0x7E5A, "bf16": 0x7FDA, "f32": 0x7FC05A5A}

GUARD_ALIGN = 256      # the interior starts 256-byte aligned, as cudaMalloc memory does (TMA needs 16, vectors 16)


def guard_pattern(nbytes: int, device="cpu"):
    """A byte pattern of period 251 (prime, so no write of a repeated word reproduces it by chance)."""
    import torch

    return ((torch.arange(nbytes, device=device, dtype=torch.int64) * 151 + 89) % 251).to(torch.uint8)


def guard_bytes_for(nbytes: int) -> int:
    """Guards scale with the buffer so that a tile-sized overrun lands in them and not in another tensor, and stay
    small enough for the largest problems: 1 MiB .. 64 MiB."""
    g = min(max(nbytes // 8, 1 << 20), 64 << 20)
    return (g + GUARD_ALIGN - 1) // GUARD_ALIGN * GUARD_ALIGN


class GuardedBuffer:
    """A byte buffer [guard | interior (nbytes) | guard] with the guards filled with `guard_pattern`."""

    def __init__(self, name: str, nbytes: int, device, guard_bytes: int | None = None):
        import torch

        self.name = name
        self.nbytes = nbytes
        self.guard = guard_bytes if guard_bytes is not None else guard_bytes_for(nbytes)
        if self.guard % GUARD_ALIGN:
            raise ValueError(f"guard of {name} must be a multiple of {GUARD_ALIGN} bytes, got {self.guard}")
        self.raw = torch.empty(self.guard + nbytes + self.guard, dtype=torch.uint8, device=device)
        self.pattern = guard_pattern(self.guard, device)
        self.fill_guards()

    @property
    def interior(self):
        return self.raw[self.guard:self.guard + self.nbytes]

    def view(self, dtype, shape):
        return self.interior.view(dtype).view(shape)

    def data_ptr(self) -> int:
        return self.raw.data_ptr() + self.guard

    def fill_guards(self):
        self.raw[:self.guard].copy_(self.pattern)
        self.raw[self.guard + self.nbytes:].copy_(self.pattern)

    def check_guards(self) -> str | None:
        """None if both guards are intact, else what was written where."""
        import torch

        problems = []
        for side, region in (("before", self.raw[:self.guard]), ("after", self.raw[self.guard + self.nbytes:])):
            bad = torch.nonzero(region != self.pattern).flatten()
            if bad.numel():
                first, last = int(bad[0]), int(bad[-1])
                if side == "before":
                    where = f"bytes -{self.guard - first}..-{self.guard - last} before its start"
                else:
                    where = f"bytes +{first}..+{last} past its end"
                problems.append(f"{self.name}: {bad.numel()} guard bytes changed, {where}")
        return "; ".join(problems) or None


def poison(c, out: str):
    """Fill C (any float dtype view) with the poison bit pattern."""
    bits = c.view(_int_dtype(out))
    bits.fill_(POISON_BITS[out])


def bits_differing(c, first, out: str):
    """How many elements of C differ from `first` in their bits, as a 0-d tensor (no host sync; NaN == NaN)."""
    return (c.view(_int_dtype(out)) != first.view(_int_dtype(out))).sum()


def poisoned_count(c, out: str):
    """How many elements still hold the poison, as a 0-d tensor (no host sync)."""
    return (c.view(_int_dtype(out)) == POISON_BITS[out]).sum()


def unwritten(c, out: str, tile: tuple[int, int] = (64, 64)) -> tuple[int, str]:
    """(number of elements still holding the poison, where they are)."""
    import torch

    mask = c.view(_int_dtype(out)) == POISON_BITS[out]
    count = int(mask.sum())
    if not count:
        return 0, ""
    idx = torch.nonzero(mask)
    i0, j0 = int(idx[0, 0]), int(idx[0, 1])
    i1, j1 = int(idx[:, 0].max()), int(idx[:, 1].max())
    rows = sorted({int(r) for r in torch.unique(idx[:, 0] // tile[0])})
    cols = sorted({int(r) for r in torch.unique(idx[:, 1] // tile[1])})
    return count, (f"{count} of {c.numel()} elements unwritten, first C[{i0},{j0}], spanning rows "
                   f"{int(idx[:, 0].min())}..{i1}, cols {int(idx[:, 1].min())}..{j1} "
                   f"({len(rows)}x{len(cols)} {tile[0]}x{tile[1]} regions)")


def _int_dtype(out: str):
    import torch

    return torch.int32 if out == "f32" else torch.int16


# ---------------------------------------------------------------------------------------------------------------
# Shapes.
# ---------------------------------------------------------------------------------------------------------------


def _is_prime(x: int) -> bool:
    if x < 2:
        return False
    for p in range(2, int(math.isqrt(x)) + 1):
        if x % p == 0:
            return False
    return True


def prime_above(d: int) -> int:
    """The smallest prime > d: divisible by no tile, with alignment 1."""
    x = d + 1
    while not _is_prime(x):
        x += 1
    return x


def odd_multiple_of_8_near(d: int) -> int:
    """The nearest x >= d with x = 8 (mod 16): aligned for 16-byte vectors of f16, divisible by no tile >= 16."""
    x = (d + 7) // 8 * 8
    return x if x % 16 == 8 else x + 8


def ragged_shapes(problem: Problem, tile: tuple[int, int, int] | None = None) -> list[tuple[int, int, int]]:
    """Nearby shapes that no tile divides: all three dims prime, all three odd multiples of 8 (for kernels that
    need 16-byte alignment), one dim at a time, and a shape smaller than one tile. Given the kernel's tile, also
    remainders of tile-8 and tile/2+8 in every dimension at once (8-aligned), so the residue paths meet long and
    short remainders next to full tiles."""
    m, n, k = problem.shape
    p = (prime_above(m), prime_above(n), prime_above(k))
    o = (odd_multiple_of_8_near(m), odd_multiple_of_8_near(n), odd_multiple_of_8_near(k))
    shapes = [p, o, (o[0], n, k), (m, o[1], k), (m, n, o[2]), (37, 41, 43), (24, 40, 56)]
    if tile is not None:
        for rem in (lambda t: max(8, t - 8), lambda t: t // 2 + 8):
            shapes.append(tuple(d // t * t + rem(t) for d, t in zip((m, n, k), tile)))
    out: list[tuple[int, int, int]] = []
    for s in shapes:
        if s != problem.shape and s not in out:
            out.append(s)
    return out


def admits(kernel: Kernel, problem: Problem) -> tuple[bool, str]:
    """Whether the kernel may be run on this problem, and if not why: the verifier's problem rules decide
    (divisibility, alignment, split-K vs K); a Source kernel has no Pad and must handle any shape."""
    from l2ir.verify import check_problem

    try:
        check_problem(kernel, problem)
    except VerifyError as e:
        return False, str(e)
    return True, ""
