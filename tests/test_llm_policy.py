"""The LLM policy on the CPU: parse-back of hand-written replies, the prompt, the repair loop, the OpenAI adapter
against a chat-completions server on 127.0.0.1 (slow, malformed, truncated and error replies), and `l2ir tune
--policy llm --standin` recording its model calls and their outcomes in the records DB."""

from __future__ import annotations

import json
import re
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from l2ir.nodes import NODE_TYPES
from l2ir.policy.base import Context, Measured, Step, get_policy
from l2ir.policy.llm import LLMPolicy, host_code, parse_reply
from l2ir.policy.model_backends import BackendError, ScriptedBackend
from l2ir.policy.prompts import Facts, node_grammar, roofline_us, user_prompt
from l2ir.seed import seed
from l2ir.text import parse_problem

PROBLEM = parse_problem("gemm m=4096 n=4096 k=4096 a=f16:row b=f16:col c=f16:row acc=f32")
PARENT = seed(PROBLEM, "sm90a")

CUDA = """\
extern "C" __global__ void my_gemm(const void* A, const void* B, void* C, int M, int N, int K, void* ws) {
  int r = blockIdx.y * 16 + threadIdx.y, c = blockIdx.x * 16 + threadIdx.x;
  if (r >= M || c >= N) return;
  const __half* a = (const __half*)A; const __half* b = (const __half*)B; float acc = 0.f;
  for (int k = 0; k < K; ++k) acc += __half2float(a[r * K + k]) * __half2float(b[c * K + k]);
  ((__half*)C)[r * N + c] = __float2half(acc);
}"""


def ctx(**kw):
    kw.setdefault("count", 4)
    return Context(problem=PROBLEM, parent=PARENT, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Parse-back
# ---------------------------------------------------------------------------------------------------------------


def test_edits_in_prose_and_in_blocks_are_separate_proposals():
    reply = ("I'd deepen the ring and shrink the tile:\n"
             "- `set pipeline.stages = 4`\n"
             "2. set tile.block = 128x128x64.\r\n"
             "Also setting things up is nice.\n"          # prose that is not an edit line
             "```l2ir\nset pipeline.stages = 5\nremove swizzle\n```\n")
    p = parse_reply(reply)
    assert p.errors == []
    kinds = {where: [str(e) for e in prop.edits] for prop, where in p.proposals}
    assert kinds["block 1 (l2ir)"] == ["set pipeline.stages = 5", "remove swizzle"]
    assert kinds["prose"] == ["set pipeline.stages = 4", "set tile.block = 128x128x64"]


def test_a_whole_kernel_parses_to_a_kernel_proposal():
    reply = "Here is the kernel:\n```\n" + PARENT.replace(
        pipeline=PARENT.pipeline.__class__(PARENT.pipeline.mode, 3, PARENT.pipeline.schedule,
                                           PARENT.pipeline.prefetch, PARENT.pipeline.persistent)).text() + "```\n"
    (prop, where), = parse_reply(reply).proposals
    assert prop.kernel is not None and prop.kernel.pipeline.stages == 3 and where == "block 1 (untagged)"


def test_node_lines_without_the_kernel_braces_are_a_kernel():
    body = "\n".join(PARENT.text().strip().splitlines()[1:-1])
    (prop, _), = parse_reply("```l2ir\n" + body + "\n```").proposals
    assert prop.kernel == PARENT
    bad = body.replace("tile block=", "tile blok=")
    err, = parse_reply("Here:\n```l2ir\n" + bad + "\n```").errors
    assert "reply line 4:" in err and "tile has no field 'blok'" in err


def test_cuda_with_its_launch_line_becomes_a_source_kernel_that_verifies():
    reply = ("A naive kernel, one thread per output:\n"
             "source entry=my_gemm grid=(cdiv(n, 16), cdiv(m, 16), 1) block=16x16x1 smem=0\n"
             "```cuda\n" + CUDA + "\n```\n")
    (prop, _), = parse_reply(reply).proposals
    k = prop.apply(PARENT, PROBLEM)
    assert k.is_source and k.source.entry == "my_gemm" and k.source.block == (16, 16, 1)
    assert k.target.arch == "sm90a" and "__half2float" in k.source.code
    # The launch line may also be a comment inside the block.
    (prop2, _), = parse_reply("```cu\n// source entry=my_gemm grid=(cdiv(n, 16), cdiv(m, 16), 1) block=16x16x1 "
                              "smem=0\n" + CUDA + "\n```").proposals
    assert prop2.kernel.source.grid == k.source.grid


def test_cuda_without_launch_line_says_what_line_to_add():
    p = parse_reply("```cuda\n" + CUDA + "\n```")
    assert not p.proposals
    assert "source entry=my_gemm grid=" in p.errors[0] and "reply line 2" in p.errors[0]


@pytest.mark.parametrize("host, what", [
    ("int main() { return 0; }", "host main()"),
    ("void go() { my_gemm<<<1, 1>>>(0, 0, 0, 1, 1, 1, 0); }", "kernel launch"),
    ("void go() { void* p; cudaMalloc(&p, 16); }", "CUDA runtime call"),
    ('void go() { system("rm -rf /"); }', "process or file call"),
])
def test_host_code_is_refused_with_its_reason_and_line(host, what):
    reply = ("source entry=my_gemm grid=(1, 1, 1) block=16x16x1 smem=0\n```cuda\n" + CUDA + "\n" + host
             + "\n```\n")
    p = parse_reply(reply)
    assert not p.proposals
    err, = p.errors
    assert "refused" in err and what in err and "host code is never run" in err
    assert "reply line 10:1" in err        # the host line is the 8th line of the block that starts on line 3
    assert host_code(CUDA) is None


def test_errors_in_prose_edits_are_located_in_the_reply_line():
    err, = parse_reply("Plan:\n  - `set tile.blok = 128x128x64`\n").errors
    assert "edit in prose, reply line 2:15:" in err       # 'blok' starts at column 15 of '  - `set tile.blok'


def test_errors_are_located_at_the_reply_line_and_column():
    reply = "Try this.\n\n```l2ir\nset pipeline.stages = 4\nset tile.blok = 128x128x64\n```\n"
    p = parse_reply(reply)
    assert not p.proposals
    err, = p.errors
    assert "reply line 5:10" in err and "tile has no field 'blok'" in err and "block 1 (l2ir)" in err


@pytest.mark.parametrize("garbage", [
    "", "\x00\x01\x02", "```", "```l2ir\nset pipeline.stages = ", "kernel { target arch=", "}}}```{{{",
    "set set set", "```cuda\n__global__ void f(\n```", "I cannot help with that.", "```\nkernel {\n```",
    "remove", "```l2ir\nreplace tile with mma op=wgmma shape=64x64x16\n```", "🙂" * 50,
])
def test_garbage_never_raises_and_always_says_why(garbage):
    p = parse_reply(garbage)
    assert p.errors and p.verdict == "unparsed"
    assert all(isinstance(e, str) and e for e in p.errors)


def test_a_reply_cut_off_inside_a_block_is_reported():
    p = parse_reply("ok:\n```l2ir\nset pipeline.stages = 4\nset tile.bl")
    assert not p.proposals and "never closed" in p.errors[0] and "reply line 2" in p.errors[0]


# ---------------------------------------------------------------------------------------------------------------
# The prompt
# ---------------------------------------------------------------------------------------------------------------


def test_the_grammar_in_the_prompt_is_the_node_schema():
    g = node_grammar()
    for kind, cls in NODE_TYPES.items():
        line = next(ln for ln in g.splitlines() if ln.split()[0] == kind)
        for name, ftype in cls.field_types().items():
            assert f"{name}" in line and ftype.describe in line


def test_prompt_has_numbers_relatives_and_the_repair():
    t = 500.0
    text = user_prompt(Facts(PROBLEM, PARENT.text(), speedup=1.1, time_us=t, registers=168, spills=0,
                             sass={"HGMMA": 64}, repair="node tile, rule mma_fits: too big"))
    tflops = PROBLEM.flops / (t * 1e6)
    assert f"{tflops:.1f} TFLOP/s" in text and f"{roofline_us(PROBLEM) / t:.0%} of the H200 roofline" in text
    assert "168 registers" in text and "0 bytes spilled" in text and "HGMMA 64" in text
    assert "rule mma_fits" in text and PARENT.text().strip() in text and "m=4096 n=4096 k=4096" in text
    # Unknown numbers are left out, not invented.
    assert "not yet measured" in user_prompt(Facts(PROBLEM, PARENT.text()))
    # A 4096^3 GEMM is compute-bound: its roofline is its FLOPs at the tensor-core peak.
    assert math.isclose(roofline_us(PROBLEM), PROBLEM.flops / 989e6, rel_tol=1e-9)


def test_contrasting_relatives_are_the_best_and_the_worst():
    def variant(stages):
        return PARENT.replace(pipeline=PARENT.pipeline.__class__(PARENT.pipeline.mode, stages,
                                                                 PARENT.pipeline.schedule))
    hist = (Step(variant(2), (), math.log(0.5)), Step(variant(3), (), math.log(1.3)),
            Step(variant(4), (), math.log(0.9)), Step(variant(5), (), None))
    pol = LLMPolicy(ScriptedBackend([""]), relatives=1)
    f = pol.facts(ctx(history=hist))
    assert [r.reward for r in f.best] == [math.log(1.3)] and [r.reward for r in f.worst] == [math.log(0.5)]
    text = user_prompt(f)
    assert "best: 1.300x torch.matmul" in text and "worst: 0.500x torch.matmul" in text


# ---------------------------------------------------------------------------------------------------------------
# The policy: checks, repair, never raising
# ---------------------------------------------------------------------------------------------------------------


def test_verifier_errors_go_back_to_the_model_and_the_repair_is_used():
    bad = "```l2ir\nset tile.block = 96x40x24\n```"
    good = "```l2ir\nset pipeline.stages = 3\n```"
    be = ScriptedBackend([bad, good])
    pol = LLMPolicy(be, repairs=1)
    props = pol.propose(ctx())
    assert len(be.calls) == 2
    repair = be.calls[1][-1]["content"]
    assert "node tile, rule" in repair and "block 1 (l2ir)" in repair
    assert be.calls[1][-2] == {"role": "assistant", "content": bad}
    (p,) = props
    assert [str(e) for e in p.edits] == ["set pipeline.stages = 3"]
    assert p.apply(PARENT, PROBLEM).pipeline.stages == 3


def test_repeats_of_the_parent_and_of_history_are_dropped_before_the_gpu():
    same = f"```l2ir\nset pipeline.stages = {PARENT.pipeline.stages}\n```"
    be = ScriptedBackend([same])
    assert LLMPolicy(be, repairs=0).propose(ctx()) == []


@pytest.mark.parametrize("reply", ["", "```", "\x00" * 10, "kernel {", "```cuda\nint main(){}\n```"])
def test_garbled_replies_give_no_proposals_and_no_exception(reply):
    pol = LLMPolicy(ScriptedBackend([reply]), repairs=2)
    assert pol.propose(ctx()) == []
    assert pol.stats["calls"] == 3


def test_a_backend_that_raises_is_an_empty_step():
    def boom(messages):
        raise RuntimeError("model exploded")
    pol = LLMPolicy(ScriptedBackend(boom))
    assert pol.propose(ctx()) == []


def test_registry_builds_the_llm_policy_from_the_environment(monkeypatch):
    monkeypatch.setenv("L2IR_LLM_BACKEND", "nonsense")
    with pytest.raises(BackendError, match="L2IR_LLM_BACKEND='nonsense'"):
        get_policy("llm")
    pytest.importorskip("openai")
    monkeypatch.setenv("L2IR_LLM_BACKEND", "openai")
    monkeypatch.delenv("L2IR_LLM_MODEL", raising=False)
    monkeypatch.delenv("OPENAI_MODEL", raising=False)
    with pytest.raises(BackendError, match="L2IR_LLM_MODEL"):
        get_policy("llm")
    monkeypatch.setenv("L2IR_LLM_MODEL", "m")
    monkeypatch.setenv("L2IR_LLM_BASE_URL", "http://127.0.0.1:9/v1")
    pol = get_policy("llm")
    assert pol.name == "llm" and pol.backend.model == "m" and pol.backend.base_url == "http://127.0.0.1:9/v1"


# ---------------------------------------------------------------------------------------------------------------
# The OpenAI adapter against a chat-completions server on 127.0.0.1
# ---------------------------------------------------------------------------------------------------------------


class ChatServer:
    """A chat-completions endpoint whose answers follow a script: each request takes the next behaviour (the last
    one repeats). Behaviours: ("ok", text[, finish]), ("slow", seconds, text), ("malformed",), ("cut",),
    ("status", code), or a function of the request body returning text."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                b = server.script[min(len(server.requests) - 1, len(server.script) - 1)]
                if callable(b):
                    b = ("ok", b(body))
                if b[0] == "slow":
                    time.sleep(b[1])
                    b = ("ok", b[2])
                if b[0] == "status":
                    return self._send(b[1], json.dumps({"error": {"message": f"scripted {b[1]}"}}).encode())
                if b[0] == "malformed":
                    return self._send(200, b'{"id": "x", "choices": [{"message": ')
                if b[0] == "cut":   # says 4000 bytes, sends 40 and closes: a proxy that dropped the connection
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "4000")
                    self.end_headers()
                    self.wfile.write(b'{"id": "x", "object": "chat.completion", ')
                    self.wfile.flush()
                    self.close_connection = True
                    return
                text, finish = b[1], (b[2] if len(b) > 2 else "stop")
                reply = {"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": finish,
                                      "message": {"role": "assistant", "content": text}}],
                         "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}
                self._send(200, json.dumps(reply).encode())

            def _send(self, code, data):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def backend(url, **kw):
    from l2ir.policy.model_backends import OpenAIBackend

    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("retries", 2)
    return OpenAIBackend(base_url=url, model="test-model", api_key="k", backoff_s=0.01, **kw)


MSG = [{"role": "user", "content": "hi"}]


def test_openai_adapter_reply_tokens_and_cost():
    pytest.importorskip("openai")
    with ChatServer([("ok", "```l2ir\nset pipeline.stages = 3\n```")]) as s:
        r = backend(s.url, price=(1.0, 2.0)).complete(MSG, max_tokens=64, temperature=0.2, seed=7)
    assert r.error is None and r.text.startswith("```l2ir") and not r.truncated
    assert (r.prompt_tokens, r.reply_tokens) == (100, 20) and math.isclose(r.cost, 100e-6 + 40e-6)
    req, = s.requests
    assert req["model"] == "test-model" and req["max_tokens"] == 64 and req["seed"] == 7 and req["messages"] == MSG


def test_openai_adapter_retries_a_slow_reply_after_its_timeout():
    pytest.importorskip("openai")
    with ChatServer([("slow", 3.0, "late"), ("ok", "in time")]) as s:
        r = backend(s.url, timeout_s=0.5).complete(MSG)
    assert r.error is None and r.text == "in time" and len(s.requests) == 2


def test_openai_adapter_gives_up_on_a_server_that_is_always_slow():
    pytest.importorskip("openai")
    with ChatServer([("slow", 2.0, "late")]) as s:
        t0 = time.monotonic()
        r = backend(s.url, timeout_s=0.3, retries=1).complete(MSG)
    assert r.text == "" and "Timeout" in r.error and len(s.requests) == 2 and time.monotonic() - t0 < 10


def test_openai_adapter_malformed_json_is_retried_then_an_error():
    pytest.importorskip("openai")
    with ChatServer([("malformed",), ("ok", "fine")]) as s:
        r = backend(s.url).complete(MSG)
    assert r.error is None and r.text == "fine" and r.attempts == 2
    with ChatServer([("malformed",)]) as s:
        r = backend(s.url, retries=1).complete(MSG)
    assert r.text == "" and r.error.startswith("malformed response") and len(s.requests) == 2


def test_openai_adapter_a_cut_connection_is_retried():
    pytest.importorskip("openai")
    with ChatServer([("cut",), ("ok", "after the cut")]) as s:
        r = backend(s.url).complete(MSG)
    assert r.error is None and r.text == "after the cut" and len(s.requests) == 2


def test_openai_adapter_truncated_reply_is_flagged_and_parsed_as_cut_off():
    pytest.importorskip("openai")
    with ChatServer([("ok", "```l2ir\nset pipeline.stages = 4\nset tile.blo", "length")]) as s:
        r = backend(s.url).complete(MSG)
    assert r.truncated and r.error is None
    assert "never closed" in parse_reply(r.text).errors[0]


@pytest.mark.parametrize("code, tries", [(400, 1), (401, 1), (404, 1), (500, 3), (503, 3), (429, 3)])
def test_openai_adapter_http_errors(code, tries):
    pytest.importorskip("openai")
    with ChatServer([("status", code)]) as s:
        r = backend(s.url).complete(MSG)
    assert r.text == "" and r.error.startswith(f"HTTP {code}") and len(s.requests) == tries


def test_the_concurrency_limit_holds_requests_back():
    pytest.importorskip("openai")
    with ChatServer([("slow", 0.3, "x")]) as s:
        be = backend(s.url, concurrency=1)
        t0 = time.monotonic()
        threads = [threading.Thread(target=be.complete, args=(MSG,)) for _ in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert time.monotonic() - t0 >= 0.85 and len(s.requests) == 3


# ---------------------------------------------------------------------------------------------------------------
# l2ir tune --policy llm --standin: trajectories in the records DB
# ---------------------------------------------------------------------------------------------------------------


class _Answers:
    """A scripted model that reads the prompt: a rejection is answered with a legal edit; otherwise it proposes a
    raster group (a new one each call), an illegal tile and a host-code block."""

    def __init__(self):
        self.n = 0

    def __call__(self, body):
        self.n += 1
        group = (1, 2, 4, 16, 32, 64, 128, 256)[self.n % 8]
        if "rejected" in body["messages"][-1]["content"]:
            return f"```l2ir\nset swizzle.raster = along_m\nset swizzle.group = {group}\n```"
        return (f"Grouped rasterization reuses B tiles in L2.\n```l2ir\nset swizzle.raster = along_n\n"
                f"set swizzle.group = {group}\n```\n```l2ir\nset tile.block = 96x40x24\n```\n"
                "```cuda\nint main() { cudaMalloc(0, 0); }\n```\n")


def test_tune_policy_llm_standin_records_trajectories(tmp_path, monkeypatch):
    pytest.importorskip("openai")
    from l2ir.cli import main
    from l2ir.search.db import RecordsDB

    with ChatServer([_Answers()]) as s:
        monkeypatch.setenv("L2IR_LLM_BACKEND", "openai")
        monkeypatch.setenv("L2IR_LLM_BASE_URL", s.url)
        monkeypatch.setenv("L2IR_LLM_MODEL", "scripted")
        monkeypatch.setenv("L2IR_LLM_PRICE", "1,1")
        db_path = tmp_path / "r.db"
        rc = main(["tune", "--policy", "llm", "--standin", "--shape", "2048x2048x2048", "--budget-candidates",
                   "9", "--init-size", "3", "--db", str(db_path), "--seed", "1"])
    assert rc == 0
    db = RecordsDB(db_path)
    run = db.runs()[-1]
    assert run["policy"] == "llm"
    calls = db.llm_calls(run["id"])
    assert calls and all(c["model"] == "scripted" and c["prompt_tokens"] == 100 for c in calls)
    assert all(c["problem"].startswith("gemm m=2048 n=2048 k=2048") and c["parent"] for c in calls)
    first = calls[0]
    assert first["cost"] == pytest.approx(120e-6)
    assert any("host main()" in e for e in first["errors"]) and any("node tile, rule" in e for e in first["errors"])
    assert json.loads(first["prompt"])[0]["role"] == "system"
    # Later prompts carry the parent's measured time from the records DB, as TFLOP/s and roofline share.
    assert any("TFLOP/s" in json.loads(c["prompt"])[1]["content"] and "of the H200 roofline" in
               json.loads(c["prompt"])[1]["content"] for c in calls)
    outcomes = [o for c in calls for o in c["outcomes"]]
    assert outcomes and {o["verdict"] for o in outcomes} <= {"measured", "failed", "illegal"}
    assert any(o["verdict"] == "measured" and o["reward"] is not None for o in outcomes)
    from l2ir.policy.llm import summarize_calls

    summary = summarize_calls(calls)
    assert summary["calls"] == len(calls) and 0 < summary["valid_rate"] <= summary["parse_rate"] <= 1
    assert summary["measured"] == sum(o["verdict"] == "measured" for o in outcomes) > 0
    rewards = [o["reward"] if o["reward"] is not None else -1.0 for o in outcomes]
    assert summary["mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert summary["cost"] == pytest.approx(sum(c["cost"] for c in calls))
    # The same candidates are in the edits table under the policy's name, with the rewards the outcomes carry.
    edits = [e for e in db.edits(run["id"]) if e["policy"] == "llm"]
    assert edits and {round(e["reward"], 9) for e in edits if e["verdict"] == "measured"} >= {
        round(o["reward"], 9) for o in outcomes if o["verdict"] == "measured"}


def test_constrained_mode_ranks_legal_operator_edits_by_the_models_scores():
    class Scorer(ScriptedBackend):
        """Prefers deeper pipelines: the score is the stage count in the text, or -10."""

        def score(self, messages, continuations):
            self.scored = list(continuations)
            out = []
            for c in continuations:
                m = re.match(r"set pipeline\.stages = (\d+)\n```$", c)
                out.append(float(m.group(1)) if m else -10.0)
            return out

    be = Scorer([""])
    pol = LLMPolicy(be, temperature=0.0, constrained=True)
    props = pol.propose(ctx(count=2))
    assert len(be.scored) > 10 and all(c.endswith("```") for c in be.scored)
    legal_stages = sorted(int(m.group(1)) for c in be.scored
                          for m in [re.match(r"set pipeline\.stages = (\d+)\n```$", c)] if m)
    assert [str(p.edits[0]) for p in props] == [f"set pipeline.stages = {s}" for s in legal_stages[::-1][:2]]
    for p in props:
        p.apply(PARENT, PROBLEM)
    with pytest.raises(BackendError, match="scores continuations"):
        LLMPolicy(ScriptedBackend([""]), constrained=True)


@pytest.mark.nvcc
def test_cuda_from_a_reply_compiles_like_any_candidate(tmp_path):
    """The Source kernel a reply becomes is lowered and compiled by the same path as every candidate (nvcc, the
    L2IR ABI's launch plan); a reply whose CUDA does not compile is a recorded compile failure, not a crash."""
    import shutil

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.backends.registry import lower

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    opts = CompileOptions(cache_dir=str(tmp_path))
    good = "source entry=my_gemm grid=(cdiv(n, 16), cdiv(m, 16), 1) block=16x16x1 smem=0\n```cuda\n" \
           "#include <cuda_fp16.h>\n" + CUDA + "\n```"
    (prop, _), = parse_reply(good).proposals
    art = compile_plan(lower(prop.apply(PARENT, PROBLEM), PROBLEM), opts)
    assert art.ok, art.summary()
    (bad, _), = parse_reply(good.replace("acc = 0.f;", "acc = undefined_name;")).proposals
    art = compile_plan(lower(bad.apply(PARENT, PROBLEM), PROBLEM), opts)
    assert not art.ok and "undefined_name" in art.summary()
