"""Correctness gates: the arithmetic of each check, independent of how the kernel is launched.

Each gate is a recorded verdict (name, passed, detail). The evaluator runs them on the GPU with torch tensors; every
function here also runs on CPU tensors, which is how the bounds themselves are tested.

The gates:
- accuracy:        fresh randn inputs (new seed each call) vs a float64 reference, by ||C - ref||_F / ||ref||_F,
                   bound from the output rounding plus the accumulator's error growth over K (`tolerance`).
- precision_probe: inputs on which an fp16 accumulator loses everything while fp32 is exact (`probe_inputs`);
                   a kernel that accumulates in fp16 but claims acc=f32 fails it, an fp32 one passes.
- all_written:     C poisoned with a NaN bit pattern before the run; every element must have been overwritten.
- guard_bands:     every buffer sits between two guard regions filled with a known byte pattern, checked after.
- ragged_shapes:   the same checks on shapes that no tile divides (`ragged_shapes`), where the kernel allows them.
- stale_output:    a second call with fresh inputs into the same C must give the new product (no cached result).
- post_timing:     the outputs of the timed runs, re-checked against their references.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from l2ir.errors import VerifyError
from l2ir.nodes import Kernel, Problem

GATES = ("accuracy", "all_written", "guard_bands", "stale_output", "precision_probe", "ragged_shapes",
         "post_timing")


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

# Unit roundoff (half an ulp at 1.0) of each storage/accumulator type: 2^-(mantissa bits + 1).
UNIT_ROUNDOFF = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "f32": 2.0 ** -24}

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


# ---------------------------------------------------------------------------------------------------------------
# Precision probe.
# ---------------------------------------------------------------------------------------------------------------

# Along K, each period of PROBE_PERIOD positions starts with a product +BIG and ends with -BIG; every other position
# contributes SMALL. An fp16 accumulator holding BIG = 1024 has an ulp of 1, so any group of fewer than 128 SMALL
# = 2^-8 terms added to it rounds away (a tie at exactly 128 rounds to even, also away); when -BIG arrives the
# accumulator returns to about zero and the small terms of that period are gone. Hardware adds the products of one
# MMA instruction (k = 16) before rounding into an fp16 accumulator, so only the last instruction of a period keeps
# its small terms. An fp32 accumulator represents 1024 + j * 2^-8 exactly (19 significant bits), so a correct kernel
# gets the exact sum and only the fp16 output rounding remains.
PROBE_PERIOD = 256
PROBE_BIG_A, PROBE_BIG_B = 32.0, 32.0        # products +-1024
PROBE_SMALL_A, PROBE_SMALL_B = 2.0 ** -4, 2.0 ** -4   # products 2^-8
PROBE_MIN_K = 64


def probe_pattern(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The K-long a and b vectors of the probe (float64, all exactly representable in f16 and bf16)."""
    a = np.full(k, PROBE_SMALL_A)
    b = np.full(k, PROBE_SMALL_B)
    for start in range(0, k, PROBE_PERIOD):
        end = min(start + PROBE_PERIOD, k) - 1
        if end > start:
            a[start], b[start] = PROBE_BIG_A, PROBE_BIG_B
            a[end], b[end] = PROBE_BIG_A, -PROBE_BIG_B
    return a, b


def probe_scales(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-row and per-column scales in {+-1, +-2}: powers of two keep every sum exact, and a fresh draw per call
    keeps a kernel from recognising the probe."""
    choices = np.array([1.0, -1.0, 2.0, -2.0])
    return rng.choice(choices, size=rows), rng.choice(choices, size=cols)


def probe_inputs(m: int, n: int, k: int, rng: np.random.Generator):
    """(a, b, r, s, dot) with A = outer(r, a) (m x k), B = outer(b, s) (k x n), exact C = outer(r, s) * dot.
    Vectors, not matrices: the caller builds the outer products where the data lives (on the GPU)."""
    a, b = probe_pattern(k)
    r, s = probe_scales(m, n, rng)
    return a, b, r, s, float(np.dot(a, b))


def f16_accumulated_dot(a: np.ndarray, b: np.ndarray, group: int) -> float:
    """The dot product an fp16 accumulator gives when each group of `group` products is summed exactly and then
    added to the accumulator with one fp16 rounding (group=1: a scalar hfma loop; 16: an mma with f16 C/D)."""
    prods = a * b
    acc = np.float16(0.0)
    for start in range(0, len(prods), group):
        acc = np.float16(float(acc) + float(prods[start:start + group].sum()))
    return float(acc)


def probe_f16_error(k: int, groups=(1, 8, 16, 32)) -> float:
    """The smallest relative error an fp16-accumulating kernel makes on the probe, over plausible rounding groups."""
    a, b = probe_pattern(k)
    exact = float(np.dot(a, b))
    if exact == 0:
        return 0.0
    return min(abs(f16_accumulated_dot(a, b, g) - exact) / abs(exact) for g in groups)


def probe_k(kernel: Kernel, problem: Problem) -> int | None:
    """The K to probe at: the problem's own if the probe separates there, else the smallest multiple of it that
    does and that the kernel accepts (a multiple keeps any divisibility the kernel needs). None if neither."""
    out = problem.c[0]
    for mult in range(1, 65):
        k = problem.k * mult
        if k < PROBE_MIN_K or probe_f16_error(k) < 10 * tolerance(k, "f32", out):
            continue
        if mult == 1 or admits(kernel, problem.with_shape(problem.m, problem.n, k))[0]:
            return k
    return None


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
    pad, tile = kernel.pad, kernel.tile
    if tile is not None:
        for dim, size, block in (("m", problem.m, tile.bm), ("n", problem.n, tile.bn), ("k", problem.k, tile.bk)):
            if getattr(pad, dim) == "divisible" and size % block:
                return False, f"pad.{dim}=divisible but {dim}={size} is not a multiple of the tile's {block}"
    lead = {"a": problem.k if problem.a[1] == "row" else problem.m,
            "b": problem.n if problem.b[1] == "row" else problem.k,
            "c": problem.n}
    for op, ld in lead.items():
        if ld % pad.align:
            return False, f"pad.align={pad.align} but the leading dimension of {op.upper()} is {ld}"
    return True, ""
