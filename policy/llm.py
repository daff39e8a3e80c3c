"""The LLM policy: any chat model proposes IR edits, whole kernels or free-form CUDA; every reply is parsed back with
the project's grammar and checked as strictly as any other proposal.

    prompt      policy/prompts.py: problem, kernel, measurements, best and worst relatives, the node grammar
    model       policy/model_backends.py: an OpenAI-compatible endpoint, or a local transformers model
    parse-back  parse_reply(): each fenced block is one proposal (edit lines, a `kernel { ... }`, or a ```cuda block
                with its `source entry=... grid=(...) block=...` launch line); edit lines in prose form one more
    check       the verifier, the problem rules and the backend's lowering (pure: no compile, no GPU); what fails
                is recorded with its error and never reaches the GPU
    repair      the errors (located line:col for text, node/rule/message for the verifier) go back to the model in
                the same conversation, `repairs` times per step; a candidate that later fails to compile or fails
                a gate sends its error into the next step's prompt for that problem

Constrained decoding (`constrained=True`, L2IR_LLM_CONSTRAINED=1; backends that score continuations: the local
model): instead of free text, the model ranks the legal children of the edit operators (policy.actions) by the
log-probability of their edit lines as its reply (per token by default: LocalBackend's `scoring`), and the step
draws from that distribution. Every proposal parses and verifies by construction, and the softmax over the options'
scores is the explicit policy a policy-gradient update trains.

Host code is never run: a CUDA block with a host main(), a <<<...>>> launch, a CUDA runtime call (cudaMalloc,
cudaMemcpy, ...) or a process/file call is refused whole, with the reason and its line, rather than cut down to its
device code: a model that wrote host code has usually written a kernel against its own launch, not against the
L2IR ABI, so keeping the device half would run it with the wrong geometry or arguments.

Trajectories: with a records DB bound (`bind_records`, done by the search loop), every model call is a row of
llm_calls (prompt, reply, model, tokens, latency, cost, the parse verdict and errors, the proposals), and the
outcome of each proposal (gate verdict, reward) is added to it when the loop's feedback comes; the edits table holds
the same candidates with the policy's name. `propose` never raises: a backend that fails, a garbled reply, or a bug
in this module is an empty step with its reason recorded.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

from l2ir.edits import parse_edits
from l2ir.errors import L2IRError, ParseError, VerifyError
from l2ir.nodes import Kernel, Target
from l2ir.text import parse_kernel_file, parse_node, print_problem

from .base import Context, Dedupe, Feedback, Proposal
from .model_backends import BackendError, ModelBackend, Reply, backend_from_env
from .prompts import Facts, Relative, system_prompt, user_prompt

_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+.-]*)[ \t]*$", re.MULTILINE)
_CUDA_TAGS = {"cuda", "cu", "c", "cpp", "c++", "cxx", "h", "hpp"}
_PROSE_EDIT = re.compile(r"^[ \t]*(?:[-*+][ \t]+|\d+[.)][ \t]+)?`?"
                         r"((?:set[ \t]+\w+\.\w+[ \t]*=|replace[ \t]+\w+[ \t]+with[ \t]|insert[ \t]+\w+[ \t]+\w+=|"
                         r"remove[ \t]+\w+[ \t]*`?[ \t]*$)[^`\n]*)`?[ \t.]*$", re.MULTILINE)
_SOURCE_LINE = re.compile(r"^[ \t]*(?://[ \t]*)?`?(source[ \t]+entry=[^`\n]*)`?[ \t]*$", re.MULTILINE)
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)\s*\(')

# What makes a CUDA block host code. The harness launches the entry point itself; nothing else of a reply runs.
HOST_CODE = (
    (re.compile(r"\bint\s+main\s*\("), "a host main()"),
    (re.compile(r"<<<"), "a kernel launch (<<<...>>>)"),
    (re.compile(r"\bcuda(?:Malloc|Memcpy|Memset|Free|LaunchKernel|DeviceSynchronize|StreamCreate|SetDevice|"
                r"HostAlloc|Graph|EventCreate)\w*\s*\("), "a CUDA runtime call"),
    (re.compile(r"\bcu(?:Init|Ctx\w+|ModuleLoad\w*|LaunchKernel|MemAlloc\w*)\s*\("), "a CUDA driver call"),
    (re.compile(r"\b(?:system|popen|fork|execv\w*|execl\w*|fopen|remove|unlink)\s*\("), "a process or file call"),
    (re.compile(r"#\s*include\s*<(?:iostream|fstream|unistd\.h|cstdlib|stdlib\.h|thread)>"), "a host-only header"),
)


@dataclass
class Block:
    lang: str
    body: str
    line: int            # reply line of the block's first body line
    closed: bool = True


def fenced_blocks(reply: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The reply's fenced blocks, and its prose lines outside them as (line, text)."""
    lines = reply.replace("\r\n", "\n").split("\n")
    blocks, prose = [], []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        start = i + 1
        j = start
        while j < len(lines) and not re.match(r"^[ \t]*```[ \t]*$", lines[j]):
            j += 1
        blocks.append(Block(m.group(1).lower(), "\n".join(lines[start:j]), start + 1, j < len(lines)))
        i = j + 1
    return blocks, prose


@dataclass
class Parsed:
    """What a reply holds: proposals (each with where it came from) and the located errors of the parts that did
    not parse or were refused."""

    proposals: list[tuple[Proposal, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "parsed" if self.proposals else "unparsed"


def _located(e: ParseError, offset: int, what: str, col_offset: int = 0) -> str:
    """A ParseError of text that starts at reply line offset+1 (column col_offset+1), as 'reply line L:C: ...'."""
    if e.line is None:
        return f"{what}: {e.message}"
    col = f":{e.column + (col_offset if e.line == 1 else 0)}" if e.column is not None else ""
    text = f"{what}, reply line {e.line + offset}{col}: {e.message}"
    if e.source_line is not None:
        text += f" (in: {e.source_line.strip()[:120]})"
    return text


def host_code(code: str) -> tuple[str, int] | None:
    """The first host construct in `code` and its line (1-based), or None."""
    for pattern, what in HOST_CODE:
        m = pattern.search(code)
        if m:
            return what, code.count("\n", 0, m.start()) + 1
    return None


def _cuda(block: Block, launch: str | None, arch: str) -> Kernel:
    """A Source kernel from a CUDA block and its launch line; raises ParseError / ValueError with the reason."""
    found = host_code(block.body)
    if found:
        what, line = found
        raise ParseError(f"refused: the CUDA has {what}; host code is never run, send only device code with an "
                         f"extern \"C\" __global__ entry point and a `source entry=...` launch line", line, 1)
    if launch is None:
        entry = _ENTRY.search(block.body)
        name = entry.group(1) if entry else "NAME"
        raise ParseError(f"a CUDA block needs its launch line before it: `source entry={name} "
                         f"grid=(cdiv(n, 128), cdiv(m, 128), 1) block=256x1x1 smem=0`", 1, 1)
    launch = re.sub(r"\bcode=.*$", "", launch).strip()
    try:
        node = parse_node(f"{launch} code=```\n{block.body}\n```")
    except ParseError as e:
        if e.line == 1:   # an error in the launch line itself
            raise ParseError("launch line: " + e.message, None, None) from None
        raise
    return Kernel(target=Target(arch), source=node)


def parse_reply(reply: str, arch: str = "sm90a") -> Parsed:
    """Proposals from a model's reply. Never raises on any text."""
    out = Parsed()
    blocks, prose = fenced_blocks(reply)
    for n, b in enumerate(blocks, 1):
        what = f"block {n} ({b.lang or 'untagged'})"
        if not b.closed:
            out.errors.append(f"{what}, reply line {b.line - 1}: the code block is never closed (reply cut off?)")
            continue
        if not b.body.strip():
            continue
        is_cuda = b.lang in _CUDA_TAGS or "__global__" in b.body
        try:
            if is_cuda:
                before = reply.replace("\r\n", "\n").split("\n")[:b.line - 2]
                launches = _SOURCE_LINE.findall("\n".join(before[-6:]) + "\n" + b.body)
                kernel = _cuda(b, launches[-1] if launches else None, arch)
                out.proposals.append((Proposal(kernel=kernel, note="llm: free-form CUDA"), what))
            elif re.search(r"^\s*kernel\s*\{", b.body, re.MULTILINE):
                _, kernel, _ = parse_kernel_file(b.body)
                out.proposals.append((Proposal(kernel=kernel, note="llm: whole kernel"), what))
            elif re.match(r"\s*target\s+arch=", b.body):
                # Node lines without the `kernel { }` around them (small models drop it): the same kernel.
                try:
                    _, kernel, _ = parse_kernel_file("kernel {\n" + b.body + "\n}")
                except ParseError as e:
                    raise ParseError(e.message, e.line - 1 if e.line else None, e.column, e.source_line) from None
                out.proposals.append((Proposal(kernel=kernel, note="llm: whole kernel"), what))
            else:
                edits = parse_edits(b.body)
                if edits:
                    out.proposals.append((Proposal(edits=edits, note="llm: edits"), what))
        except ParseError as e:
            out.errors.append(_located(e, b.line - 1, what))
        except (L2IRError, ValueError, TypeError) as e:
            out.errors.append(f"{what}, reply line {b.line}: {e}")
    # A sentence's full stop is not part of the edit (no value ends in '.').
    edit_lines = [(ln, m.start(1), m.group(1).strip().rstrip(".").rstrip()) for ln, text in prose
                  for m in [_PROSE_EDIT.match(text)] if m]
    edits = []
    for ln, start, text in edit_lines:
        try:
            edits.extend(parse_edits(text))
        except ParseError as e:
            out.errors.append(_located(e, ln - 1, "edit in prose", start))
    if edits:
        out.proposals.append((Proposal(edits=edits, note="llm: edits in prose"), "prose"))
    if not out.proposals and not out.errors:
        out.errors.append("the reply has no fenced block and no edit line (set/replace/insert/remove)")
    return out


def verifier_error(e: BaseException) -> str:
    """The verifier's error as the model should see it: node, rule and message."""
    if isinstance(e, VerifyError):
        return f"node {e.node}, rule {e.rule}: {e.message}"
    if isinstance(e, NotImplementedError):
        return f"the backend cannot build it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _env_int(name: str, default: int) -> int:
    return int(_env_float(name, default))


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise BackendError(f"{name}={text!r}: expected a number") from None


@dataclass
class _Call:
    id: int | None
    outcomes: list = field(default_factory=list)


class LLMPolicy:
    """Proposals from a chat model. `backend` is a ModelBackend (None: `backend_from_env()`, built with the
    policy: a bad setting fails at once, in one line); `repairs` re-asks within a step when nothing in a reply
    survives the checks; `relatives` best and as many worst earlier kernels go into each prompt."""

    name = "llm"

    def __init__(self, backend: ModelBackend | None = None, repairs: int | None = None,
                 max_tokens: int | None = None, temperature: float | None = None, relatives: int = 2, db=None,
                 run: int | None = None, constrained: bool | None = None):
        # `l2ir tune --policy llm` builds the policy with no arguments: these come from the environment then.
        repairs = repairs if repairs is not None else _env_int("L2IR_LLM_REPAIRS", 1)
        max_tokens = max_tokens if max_tokens is not None else _env_int("L2IR_LLM_MAX_TOKENS", 768)
        temperature = temperature if temperature is not None else _env_float("L2IR_LLM_TEMPERATURE", 0.7)
        constrained = constrained if constrained is not None else bool(_env_int("L2IR_LLM_CONSTRAINED", 0))
        if repairs < 0 or relatives < 0 or max_tokens < 1:
            raise ValueError(f"LLMPolicy: repairs, relatives >= 0 and max_tokens >= 1, got {repairs}, {relatives}, "
                             f"{max_tokens}")
        self.backend = backend if backend is not None else backend_from_env()
        self.repairs = repairs
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.relatives = relatives
        self.db, self.run = db, run
        if constrained and not callable(getattr(self.backend, "score", None)):
            raise BackendError(f"constrained decoding needs a backend that scores continuations (the local model); "
                               f"{type(self.backend).__name__} does not")
        self.constrained = constrained
        self._pending: dict[int, _Call] = {}
        self._repair: dict[str, str] = {}         # problem text -> the last candidate's failure, for the next prompt
        self.stats = {"calls": 0, "errors": 0, "parsed": 0, "proposals": 0, "legal": 0, "measured": 0,
                      "reward_sum": 0.0}

    def bind_records(self, db, run: int | None) -> None:
        """Record model calls and their outcomes in `db` (a search.db.RecordsDB) under run `run`."""
        self.db, self.run = db, run

    # -- prompts ------------------------------------------------------------------------------------------------

    def facts(self, ctx: Context) -> Facts:
        ptext = print_problem(ctx.problem)
        m = ctx.measured
        f = Facts(problem=ctx.problem, kernel_text=ctx.parent.text(), backend=ctx.backend, speedup=m.speedup,
                  time_us=m.time_us, registers=m.registers, spills=m.spills, count=ctx.count,
                  repair=self._repair.pop(ptext, None))
        if self.db is not None:
            self._facts_from_db(f, ctx, ptext)
        scored = [s for s in ctx.history if s.kernel != ctx.parent]
        measured = sorted((s for s in scored if s.reward is not None), key=lambda s: -s.reward)
        best = measured[:self.relatives]
        worst = [s for s in measured[::-1] if s not in best][:self.relatives]
        if len(worst) < self.relatives:
            worst += [s for s in scored if s.reward is None][:self.relatives - len(worst)]
        rel = lambda s: Relative(s.kernel.text(), s.reward, "; ".join(map(str, s.edits)))  # noqa: E731
        f.best, f.worst = [rel(s) for s in best], [rel(s) for s in worst]
        return f

    def _facts_from_db(self, f: Facts, ctx: Context, ptext: str) -> None:
        """Time, registers, spills and SASS counts of the parent, where the records DB has them."""
        h = ctx.parent.content_hash()
        try:
            rows = [r for r in self.db.measurements(problem=ptext, kernel=h) if r.kernel_median_us]
            if rows and f.time_us is None:
                f.time_us = float(rows[-1].kernel_median_us)
            row = self.db.kernel(h) or {}
        except Exception:  # noqa: BLE001 - a prompt without these numbers is still a prompt
            return
        for res in (row.get("resources") or {}).values():
            if isinstance(res, dict):
                if f.registers is None and res.get("registers") is not None:
                    f.registers = int(res["registers"])
                spill = res.get("spill_stores") or res.get("spills")
                if f.spills is None and spill is not None:
                    f.spills = int(spill)
        if isinstance(row.get("sass"), dict):
            counts = row["sass"].get("counts", row["sass"])
            f.sass = {k: v for k, v in counts.items() if isinstance(v, (int, float))} or None

    # -- the protocol -------------------------------------------------------------------------------------------

    def propose(self, context: Context) -> list[Proposal]:
        try:
            return self._propose(context)
        except Exception as e:  # noqa: BLE001 - a model's reply must never stop a search
            self._record(context, "", Reply("", "?", error=f"policy error: {type(e).__name__}: {e}"), "error",
                         [f"{type(e).__name__}: {e}"], [])
            return []

    def _propose(self, ctx: Context) -> list[Proposal]:
        messages = [{"role": "system", "content": system_prompt(ctx.arch)},
                    {"role": "user", "content": user_prompt(self.facts(ctx))}]
        seen = Dedupe.of(ctx)
        if self.constrained:
            return self._choose(ctx, messages, seen)
        out: list[Proposal] = []
        for attempt in range(self.repairs + 1):
            reply = self.backend.complete(messages, self.max_tokens, self.temperature,
                                          seed=(ctx.seed * 7919 + attempt) & 0x7FFFFFFF)
            self.stats["calls"] += 1
            if reply.error:
                self.stats["errors"] += 1
                self._record(ctx, json.dumps(messages), reply, "error", [reply.error], [])
                break
            parsed = parse_reply(reply.text, ctx.arch)
            errors = list(parsed.errors)
            good: list[tuple[Proposal, str]] = []
            for p, where in parsed.proposals:
                try:
                    child = p.apply(ctx.parent, ctx.problem)
                except (L2IRError, NotImplementedError) as e:
                    errors.append(f"{where}: {verifier_error(e)}")
                    continue
                except Exception as e:  # noqa: BLE001 - a checker bug rejects the proposal, never the step
                    errors.append(f"{where}: check failed: {type(e).__name__}: {e}")
                    continue
                if not seen.fresh(child, p.backend):
                    errors.append(f"{where}: gives a kernel already tried on this problem")
                    continue
                good.append((p, where))
            self.stats["parsed"] += bool(parsed.proposals)
            self.stats["proposals"] += len(parsed.proposals)
            self.stats["legal"] += len(good)
            verdict = ("legal" if good else "illegal") if parsed.proposals else parsed.verdict
            if reply.truncated:
                errors.append(f"the reply was cut off at {self.max_tokens} tokens")
            call = self._record(ctx, json.dumps(messages), reply, verdict, errors, good)
            for p, where in good:
                tagged = Proposal(edits=p.edits, kernel=p.kernel, backend=p.backend,
                                  note=f"{p.note} ({where}" + (f", llm call {call.id})" if call.id else ")"))
                self._pending[id(tagged)] = call
                out.append(tagged)
            if len(out) >= ctx.count or not errors:
                break
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": "These parts were rejected; reply with corrected blocks:\n- "
                          + "\n- ".join(errors[:8])}]
        return out[:ctx.count]

    def _choose(self, ctx: Context, messages: list, seen: Dedupe) -> list[Proposal]:
        """Constrained decoding: the model ranks the legal children of the edit operators (policy.actions) by the
        log-probability of their edit text as its reply, and `count` are drawn without replacement (Gumbel top-k
        at the policy's temperature; greedy at 0). Every proposal parses and verifies by construction, and the
        model's distribution over them is explicit, which is what a policy-gradient update trains."""
        import time

        import numpy as np

        from .actions import diff_edits, legal_children

        options: list[tuple[Proposal, str]] = []
        for _, a, child, backend in legal_children(ctx.parent, ctx.problem, ctx.arch, ctx.backend, seen):
            edits = diff_edits(ctx.parent, child)
            if edits:
                text = "".join(f"{e}\n" for e in edits)
                options.append((Proposal(edits=edits, backend=backend, note=f"llm (constrained): {a}"), text))
        if not options:
            return []
        t0 = time.monotonic()
        scores = np.array(self.backend.score(messages, [text + "```" for _, text in options]))
        latency = time.monotonic() - t0
        self.stats["calls"] += 1
        keys = scores / self.temperature + ctx.rng(salt=7).gumbel(size=len(scores)) if self.temperature > 0 \
            else scores
        picked = [int(i) for i in np.argsort(-keys)[:ctx.count]]
        good = [(options[i][0], f"option {i}") for i in picked]
        reply_text = "".join(f"```l2ir\n{options[i][1]}```\n" for i in picked)
        self.stats["parsed"] += 1
        self.stats["proposals"] += len(good)
        self.stats["legal"] += len(good)
        reply = Reply(reply_text, getattr(self.backend, "model", "?"), 0, 0, latency, 0.0)
        call = self._record(ctx, json.dumps(messages), reply, "legal", [], good)
        scoring = getattr(self.backend, "scoring", None)     # mean: per token; sum: the edit's whole log-prob
        label = f"{scoring} " if isinstance(scoring, str) else ""
        out = []
        for (p, where), i in zip(good, picked):
            tagged = Proposal(edits=p.edits, backend=p.backend,
                              note=f"{p.note} ({label}log p {scores[i]:.2f}"
                              + (f", llm call {call.id})" if call.id else ")"))
            self._pending[id(tagged)] = call
            out.append(tagged)
        return out

    def update(self, feedback: list[Feedback]) -> None:
        for fb in feedback:
            call = self._pending.pop(id(fb.proposal), None)
            if fb.verdict == "measured" and fb.reward is not None and math.isfinite(fb.reward):
                self.stats["measured"] += 1
                self.stats["reward_sum"] += fb.reward
            elif fb.detail:
                self._repair[print_problem(fb.context.problem)] = (
                    f"the kernel from your {fb.proposal.note or 'proposal'} was {fb.verdict}: {fb.detail[:400]}")
            if call is None:
                continue
            call.outcomes.append({"proposal": fb.proposal.text()[:2000], "verdict": fb.verdict,
                                  "reward": fb.reward, "detail": fb.detail[:400],
                                  "child": fb.kernel.content_hash() if fb.kernel is not None else None})
            if self.db is not None and call.id is not None:
                self.db.set_llm_outcomes(call.id, call.outcomes)

    def state_dict(self) -> dict:
        return {"stats": dict(self.stats)}

    def load_state_dict(self, state: dict | bytes) -> None:
        if isinstance(state, dict) and isinstance(state.get("stats"), dict):
            self.stats.update({k: v for k, v in state["stats"].items() if k in self.stats})

    # -- records ------------------------------------------------------------------------------------------------

    def _record(self, ctx: Context, prompt: str, reply: Reply, verdict: str, errors: list[str],
                good: list[tuple[Proposal, str]]) -> _Call:
        call = _Call(None)
        if self.db is None:
            return call
        try:
            call.id = self.db.add_llm_call(
                self.run, prompt, reply.text, reply.model, reply.prompt_tokens, reply.reply_tokens, reply.latency_s,
                cost=reply.cost, problem=print_problem(ctx.problem), parent=ctx.parent.content_hash(),
                verdict=verdict, errors=json.dumps(errors), proposals=json.dumps([p.text() for p, _ in good]))
        except Exception:  # noqa: BLE001 - a records failure must not stop the step; the edits table still has it
            call.id = None
        return call


def summarize_calls(calls: list[dict], fail_reward: float = -1.0) -> dict:
    """What a set of model calls (RecordsDB.llm_calls rows) achieved: the valid-reply rate (replies with at least
    one proposal that passed the checks), the parse rate, and the mean reward of their proposals (log speedup when
    measured, `fail_reward` when a candidate failed a compile or a gate; the loop's FAIL_REWARD by default). The
    numbers a fine-tuned policy is compared by, before and after, on held-out shapes."""
    n = len(calls)
    outcomes = [o for c in calls for o in (c.get("outcomes") or [])]
    rewards = [o["reward"] if o.get("reward") is not None else fail_reward for o in outcomes]
    measured = [o["reward"] for o in outcomes if o.get("verdict") == "measured" and o.get("reward") is not None]
    return {
        "calls": n,
        "backend_errors": sum(c.get("verdict") == "error" for c in calls),
        "parse_rate": sum(c.get("verdict") in ("legal", "illegal") for c in calls) / n if n else None,
        "valid_rate": sum(c.get("verdict") == "legal" for c in calls) / n if n else None,
        "proposals": len(outcomes),
        "measured": len(measured),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "mean_measured_reward": sum(measured) / len(measured) if measured else None,
        "tokens": sum((c.get("prompt_tokens") or 0) + (c.get("reply_tokens") or 0) for c in calls),
        "cost": sum(c.get("cost") or 0.0 for c in calls),
        "latency_s": sum(c.get("latency_s") or 0.0 for c in calls),
    }
