"""The LLM policy's prompts: the problem, the parent kernel and what was measured about it, contrasting relatives
with their measured speedups, the edit grammar (made from the node schema, so it cannot drift from the parser), and
the verifier's error on the previous reply when the model is asked to repair.

    system_prompt(arch)                   what the model is, the three answer forms, the grammar of nodes and edits
    user_prompt(facts)                    one search step: problem, kernel, numbers, relatives, the error to repair
    node_grammar()                        every node with each field's type, from l2ir.nodes (FieldType.describe)

Numbers the model can reason with: a kernel's time, its TFLOP/s and its share of the roofline of an H200 (dense
fp16 tensor-core peak and HBM3e bandwidth): a kernel at 30% of the roofline has room that a kernel at 90% has not.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from l2ir.nodes import KERNEL_ORDER, NODE_TYPES, OPTIONAL_NODES, Problem
from l2ir.search.standin import HBM_TBPS as PEAK_TBPS
from l2ir.search.standin import PEAK_TFLOPS
from l2ir.target import H200_SMS
from l2ir.text import print_problem

# The H200's HBM3e bandwidth (PEAK_TBPS) and dense fp16 peak give the roofline a kernel is compared with.


def roofline_us(problem: Problem) -> float:
    """The shortest time the H200 can run this GEMM: its FLOPs at the tensor-core peak or its compulsory traffic
    (A and B read once, C written once) at the HBM bandwidth, whichever is longer."""
    m, n, k = problem.shape
    elem = 2   # bytes of an f16/bf16 element
    traffic = elem * (m * k + k * n + m * n)
    return max(problem.flops / (PEAK_TFLOPS * 1e6), traffic / (PEAK_TBPS * 1e6))


@dataclass(frozen=True)
class Relative:
    """An earlier kernel on this problem, with its measured log-speedup over torch.matmul (None: it failed)."""

    text: str
    reward: float | None
    how: str = ""          # the edits that made it, when known


@dataclass
class Facts:
    """What one prompt says. Unknown numbers are None and are left out of the prompt, never invented."""

    problem: Problem
    kernel_text: str
    backend: str | None = None
    speedup: float | None = None
    time_us: float | None = None
    registers: int | None = None
    spills: int | None = None
    sass: dict | None = None            # instruction counts by opcode class, when the binary was disassembled
    best: list[Relative] = field(default_factory=list)
    worst: list[Relative] = field(default_factory=list)
    repair: str | None = None           # the previous reply's error (located, or node/rule/message)
    count: int = 4


def node_grammar() -> str:
    """One line per node: `kind field=<type> ...`, the types as the parser checks them."""
    lines = []
    for name in KERNEL_ORDER:
        cls = NODE_TYPES[name]
        required = set(cls.required_fields())
        parts = []
        for f in dataclasses.fields(cls):
            ftype = f.metadata["type"]
            opt = "" if f.name in required else "?"
            parts.append(f"{f.name}{opt}=<{ftype.describe}>")
        tag = " (optional node)" if name in OPTIONAL_NODES else ""
        lines.append(f"  {name} " + " ".join(parts) + tag)
    return "\n".join(lines)


EDIT_FORMS = """\
  set NODE.FIELD = VALUE            change one field
  replace NODE with NODE_LINE       swap a whole node
  insert NODE_LINE                  add an optional node (swizzle, splitk)
  remove NODE                       drop an optional node"""


def system_prompt(arch: str = "sm90a") -> str:
    return f"""You tune half-precision GEMM kernels (C = A @ B, fp32 accumulation) for an NVIDIA H200 ({arch}, {H200_SMS} SMs,
{PEAK_TFLOPS:.0f} TFLOP/s dense fp16, {PEAK_TBPS} TB/s). Kernels are written in L2IR, a typed schedule IR, one node per line:

{node_grammar()}
(fields marked ? may be left out and take their defaults)

Answer with one or more fenced code blocks; each block is one proposal, checked by a verifier before it runs:
1. edits to the current kernel, one per line:
{EDIT_FORMS}
   e.g.
   ```l2ir
   set pipeline.stages = 4
   set tile.block = 128x128x64
   ```
2. a whole kernel in L2IR text:
   ```l2ir
   kernel {{
     target arch={arch}
     ...
   }}
   ```
3. free-form CUDA device code in a ```cuda block, with a line `source entry=NAME grid=(cdiv(n, 128), cdiv(m, 128), 1)
   block=256x1x1 smem=0` before it. The entry point is `extern "C" __global__ void NAME(const void* A, const void* B,
   void* C, int M, int N, int K, void* workspace)`; A is MxK, B is KxN, C is MxN, in the dtypes and layouts of the
   problem line (row: row-major, col: column-major).
   Device code only: no main(), no <<<...>>> launches, no cudaMalloc/cudaMemcpy; such replies are refused.
Keep prose short; explain the hardware reason in one sentence."""


def _fmt_reward(r: float | None) -> str:
    return "failed" if r is None else f"{math.exp(r):.3f}x torch.matmul"


def user_prompt(f: Facts) -> str:
    p = f.problem
    lines = [f"Problem: {print_problem(p)} ({p.flops / 1e9:.2f} GFLOP)."]
    lines.append("Current kernel" + (f" (backend {f.backend})" if f.backend else "") + ":")
    lines.append("```l2ir\n" + f.kernel_text.rstrip() + "\n```")
    numbers = []
    if f.speedup is not None:
        numbers.append(f"{f.speedup:.3f}x torch.matmul")
    if f.time_us is not None and f.time_us > 0:
        tflops = p.flops / (f.time_us * 1e6)
        numbers.append(f"{f.time_us:.2f} us, {tflops:.1f} TFLOP/s, {roofline_us(p) / f.time_us:.0%} of the H200 "
                       f"roofline ({roofline_us(p):.2f} us)")
    if f.registers is not None:
        numbers.append(f"{f.registers} registers/thread")
    if f.spills is not None:
        numbers.append(f"{f.spills} bytes spilled")
    if f.sass:
        numbers.append("SASS " + ", ".join(f"{k} {v}" for k, v in sorted(f.sass.items())))
    lines.append("Measured: " + ("; ".join(numbers) if numbers else "not yet measured") + ".")
    if f.best or f.worst:
        lines.append("Earlier kernels on this problem (learn from the contrast):")
        for tag, rel in [("best", r) for r in f.best] + [("worst", r) for r in f.worst]:
            how = f" made by: {rel.how}" if rel.how else ""
            lines.append(f"- {tag}: {_fmt_reward(rel.reward)}{how}")
            lines.append("```l2ir\n" + rel.text.rstrip() + "\n```")
    if f.repair:
        lines.append("Your previous reply was rejected, fix it:\n" + f.repair.strip())
    lines.append(f"Propose up to {f.count} faster variants.")
    return "\n".join(lines)
