"""`l2ir train-policy` on the CPU: a tiny randomly initialised causal LM (2 layers, built here, no download) with a
byte-level tokenizer trained here, LoRA through peft, and rewards from the stand-in cost model or a reward function.

Skipped without torch, transformers, tokenizers or peft (pip install '.[train]')."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "tokenizers", "peft")),
    reason="train-policy needs torch, transformers and peft: pip install '.[train]'")

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with random weights and a 512-token byte-level BPE learned from the policy's own prompts."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from l2ir.policy.prompts import system_prompt

    folder = tmp_path_factory.mktemp("tiny-lm")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = [system_prompt("sm90a"), "set pipeline.stages = 4\nset tile.block = 128x128x64\n```"] * 4
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=512, special_tokens=["<eos>", "<pad>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _args(tmp_path, model, **over):
    import argparse

    from l2ir.policy.train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--db", str(tmp_path / "r.db"), "--model", str(model), "--standin", "--steps", "2", "--group", "4",
            "--batch", "1", "--train-shapes", "1024x1024x1024", "--held-shapes", "2048x2048x2048"]
    if over.pop("standin", True) is False:
        argv.remove("--standin")
    for k, v in over.items():
        flag = f"--{k.replace('_', '-')}"
        if flag in argv:          # replace a default above (a list value: nargs="+")
            i = argv.index(flag)
            del argv[i:i + 2]
        argv += [flag] + ([] if v is True else [str(v)] if not isinstance(v, list) else v)
    return p.parse_args(argv)


def _lora_weights(lm):
    return {n: p.detach().clone() for n, p in lm.named_parameters() if "lora_" in n}


def test_a_tiny_constrained_run_on_the_standin_trains_records_and_saves(tiny_model, tmp_path, monkeypatch):
    from l2ir.policy.model_backends import LocalBackend
    from l2ir.policy.train import run_training
    from l2ir.search.db import RecordsDB

    out = tmp_path / "adapter"
    summary = run_training(_args(tmp_path, tiny_model, out=out, lr="0.05"), log=lambda m: None)
    curve = summary["curve"]
    assert len(curve) == 2 and all(math.isfinite(p["mean_reward"]) for p in curve)
    assert any(p["loss"] is not None and math.isfinite(p["loss"]) for p in curve)
    assert summary["before"]["valid_rate"] == 1.0 and summary["after"]["valid_rate"] == 1.0   # by construction
    assert summary["before"]["replies"] == 4 and summary["before"]["geomean_speedup"] > 0
    # Every reply is a trajectory: prompt, reply, verdict, outcomes with rewards, under the run it belongs to.
    db = RecordsDB(tmp_path / "r.db")
    calls = db.llm_calls()
    assert len(calls) == 4 + 2 * 4 + 4
    train = db.llm_calls(summary["runs"]["train"])
    assert len(train) == 8 and all(c["verdict"] == "legal" and c["reply"].startswith("```l2ir\n") for c in train)
    assert all(json.loads(c["prompt"])[1]["role"] == "user" for c in train)
    assert all(len(c["outcomes"]) == 1 and c["outcomes"][0]["reward"] is not None for c in train
               if c["outcomes"][0]["verdict"] == "measured")
    from l2ir.policy.llm import summarize_calls

    assert summarize_calls(train)["valid_rate"] == 1.0
    # The repeats cost nothing: every (kernel, shape) is evaluated once, a repeat is answered from memory or the DB.
    n, distinct = db.conn.execute("SELECT COUNT(*), COUNT(DISTINCT kernel || problem) FROM measurements").fetchone()
    assert n == distinct == summary["rewarder"]["evaluated"] and summary["rewarder"]["cached"] > 0
    # Before and after, the policy's expected reward over every option of the seed (exact for its distribution).
    for phase in ("before", "after"):
        assert math.isfinite(summary[phase]["expected_reward"]) and 0 <= summary[phase]["p_faster_than_torch"] <= 1
    # The adapter and the curve are on disk, and the local backend loads the adapter (merged into the weights).
    assert (out / "adapter_config.json").is_file() and json.loads((out / "train_curve.json").read_text())["curve"]
    base = LocalBackend(str(tiny_model), adapter=False)
    tuned = LocalBackend(str(tiny_model), adapter=str(out))
    msgs = [{"role": "user", "content": "faster?"}]
    a, = base.score(msgs, ["set pipeline.stages = 4\n```"])
    b, = tuned.score(msgs, ["set pipeline.stages = 4\n```"])
    assert a != b
    # `l2ir tune --policy llm` builds its backend from the environment: L2IR_LLM_ADAPTER names the adapter.
    monkeypatch.setenv("L2IR_LLM_ADAPTER", str(out))
    from_env = LocalBackend(str(tiny_model))
    assert from_env.adapter == str(out) and from_env.score(msgs, ["set pipeline.stages = 4\n```"]) == [b]
    from l2ir.policy.model_backends import BackendError

    with pytest.raises(BackendError, match="no adapter_config.json"):
        LocalBackend(str(tiny_model), adapter=str(tmp_path))
    # The scoring the adapter was trained with is in its train_curve.json, and the backend ranks with it; an
    # adapter from before the option was trained with `sum`.
    assert summary["config"]["scoring"] == "mean" and from_env.scoring == "mean"
    assert json.loads(db.conn.execute("SELECT config FROM runs WHERE id=?", (summary["runs"]["train"],))
                      .fetchone()[0])["config"]["scoring"] == "mean"
    curve = json.loads((out / "train_curve.json").read_text())
    del curve["config"]["scoring"]
    (out / "train_curve.json").write_text(json.dumps(curve))
    assert LocalBackend(str(tiny_model), adapter=str(out)).scoring == "sum"
    assert LocalBackend(str(tiny_model), adapter=str(out), scoring="mean").scoring == "mean"
    monkeypatch.setenv("L2IR_LLM_SCORING", "median")
    with pytest.raises(BackendError, match="L2IR_LLM_SCORING='median': expected one of mean, sum"):
        LocalBackend(str(tiny_model), adapter=False)


def test_the_adapter_changes_and_a_favoured_operator_gains_probability(tiny_model):
    """A reward that favours one edit (the random model's second likeliest child, and no other signal): after a few
    steps the model puts more probability on it. Fails if the sign of the update, the advantages or the log-probs are wrong. Under `sum`
    scoring (the runs before `mean`), where this short edit has a fair share of the mass to start from."""
    import numpy as np

    from l2ir.policy.train import ShapeState, TrainConfig, Trainer, function_rewarder, load_model, parse_shapes, \
        start_kernel

    problem, = parse_shapes(["1024x1024x1024"], "test")
    be = load_model(str(tiny_model), "cpu", 4, None, 0)
    parent, backend = start_kernel(problem, "sm90a")
    # The favoured edit is the random model's second likeliest option: neither its likeliest nor a rare one (the
    # prompt, and so the tokenizer trained on it, decide which edit that is).
    want = {}
    reward = function_rewarder(lambda p, k, b: 1.0 if k == want["child"] else 0.0)
    tr = Trainer(be, reward, TrainConfig(steps=6, group=8, batch=1, lr=0.05, lora_r=4, seed=1,
                                                scoring="sum"))
    st = ShapeState(problem, parent, backend, 0.0)
    tr._advance = False
    before_w = _lora_weights(be.lm)
    opts0, probs0 = tr.option_distribution(st, tr.messages(st))
    second = opts0[int(np.argsort(-probs0)[1])]
    target, want["child"] = second.text.strip(), second.child

    def p_target():
        opts, probs = tr.option_distribution(st, tr.messages(st))
        i = next(i for i, o in enumerate(opts) if o.text.strip() == target)
        return float(probs[i]), len(opts)

    p0, n = p_target()
    assert n > 10 and 0.01 < p0 < 0.5, (target, p0)
    for _ in range(6):
        msgs = tr.messages(st)
        samples = tr.sample_group(st, msgs, 8)
        tr.score_group(st, samples)
        tr.opt.zero_grad()
        loss, _ = tr.loss(msgs, samples)
        if loss is not None:
            assert math.isfinite(float(loss))
            loss.backward()
            tr.opt.step()
    p1, _ = p_target()
    after_w = _lora_weights(be.lm)
    assert any(not np.allclose(before_w[k].numpy(), after_w[k].numpy()) for k in before_w)
    # The odds of the favoured edit at least double (a measure that does not saturate near a start of one half).
    assert p1 / (1 - p1) > 2 * p0 / (1 - p0), (target, p0, p1)


def test_mean_scoring_ranks_edits_of_any_length_and_a_long_favoured_edit_gains(tiny_model):
    """Options of 9 to 120+ tokens. Summed log-probs give the shortest edits nearly all the mass whatever they say
    (every token adds a negative term); per-token means put long and short edits on one scale, so a reward that
    favours long edits (the split-K inserts, ~30 tokens) is sampled, and training under `mean` raises their
    probability. Fails if the scoring is not length-normalised, or the update is not for the sampling policy."""
    import torch

    from l2ir.policy.model_backends import MEAN_TOKENS
    from l2ir.policy.train import ShapeState, TrainConfig, Trainer, function_rewarder, load_model, parse_shapes, \
        start_kernel

    problem, = parse_shapes(["1024x1024x1024"], "test")
    be = load_model(str(tiny_model), "cpu", 4, None, 0)
    parent, backend = start_kernel(problem, "sm90a")
    st = ShapeState(problem, parent, backend, 0.0)
    trainers = {s: Trainer(be, None, TrainConfig(group=8, batch=1, lr=0.02, lora_r=4, seed=1, scoring=s))
                for s in ("sum", "mean")}
    dist = {s: tr.option_distribution(st, tr.messages(st)) for s, tr in trainers.items()}
    opts = dist["sum"][0]
    assert [o.text for o in dist["mean"][0]] == [o.text for o in opts]
    n_tok = [len(be.tok(o.text + "```", add_special_tokens=False)["input_ids"]) for o in opts]
    assert max(n_tok) > 3 * min(n_tok), n_tok
    short = [i for i, n in enumerate(n_tok) if n == min(n_tok)]
    p_sum, p_mean = dist["sum"][1][short].sum(), dist["mean"][1][short].sum()
    assert p_sum > 0.5 and p_sum > 3 * p_mean, (p_sum, p_mean)
    # The scores are the local backend's too: the summed log-prob per token (times MEAN_TOKENS).
    msgs = trainers["mean"].messages(st)
    text = opts[n_tok.index(max(n_tok))].text + "```"
    total, = be.score(msgs, [text], scoring="sum")
    mean, = be.score(msgs, [text], scoring="mean")
    assert mean == pytest.approx(total * MEAN_TOKENS / max(n_tok), rel=1e-5)

    # Train under `mean` on a reward for the long split-K edits (the options most unlike the shortest ones).
    favoured = {o.child.content_hash() for o in opts if o.text.startswith("insert splitk")}
    idx = [i for i, o in enumerate(opts) if o.child.content_hash() in favoured]
    assert idx and min(n_tok[i] for i in idx) > 2 * min(n_tok)
    assert dist["sum"][1][idx].sum() < 1e-3          # under `sum` they would (almost) never be sampled
    tr = trainers["mean"]
    tr.rewarder = function_rewarder(lambda p, k, b: 1.0 if k.content_hash() in favoured else 0.0)
    tr._advance = False
    p0 = dist["mean"][1][idx].sum()
    signals = 0
    for _ in range(6):
        samples = tr.sample_group(st, msgs, 8)
        assert all(s.draw is samples[0].draw and s.draw.logp.requires_grad for s in samples)
        tr.score_group(st, samples)
        tr.opt.zero_grad()
        loss, _ = tr.loss(msgs, samples)
        if loss is not None:
            loss.backward()
            tr.opt.step()
            signals += 1
    _, p1 = tr.option_distribution(st, msgs)
    assert signals >= 2 and p1[idx].sum() > 2 * p0, (p0, p1[idx].sum(), signals)
    # Without gradients (the held-out scoring) a group cannot be trained on: said, not silently ignored.
    with torch.no_grad():
        samples = tr.sample_group(st, msgs, 8)
    tr.score_group(st, samples)
    if len({s.reward for s in samples}) > 1:
        with pytest.raises(Exception, match="without gradients"):
            tr.loss(msgs, samples)


def test_free_text_mode_records_unparsed_replies_and_trains(tiny_model, tmp_path):
    from l2ir.policy.train import run_training
    from l2ir.search.db import RecordsDB

    summary = run_training(_args(tmp_path, tiny_model, mode="free", max_tokens=12, steps=1, held_shapes=[]),
                           log=lambda m: None)
    assert "before" not in summary and len(summary["curve"]) == 1
    calls = RecordsDB(tmp_path / "r.db").llm_calls(summary["runs"]["train"])
    # A random 2-layer model writes noise: every reply recorded with its parse verdict and the penalty.
    assert len(calls) == 4 and all(c["verdict"] in ("unparsed", "illegal", "legal") for c in calls)
    assert all(c["reply"].startswith("```l2ir\n") for c in calls)
    assert summary["curve"][0]["valid_rate"] is not None


def test_the_trainer_takes_a_kl_penalty_to_the_base(tiny_model):
    from l2ir.policy.train import ShapeState, TrainConfig, Trainer, function_rewarder, load_model, parse_shapes, \
        start_kernel

    problem, = parse_shapes(["2048x1024x512"], "test")
    be = load_model(str(tiny_model), "cpu", 4, None, 0)
    parent, backend = start_kernel(problem, "sm90a")
    tr = Trainer(be, function_rewarder(lambda p, k, b: float(k.tile.bn) / 256), TrainConfig(group=4, kl=0.5))
    st = ShapeState(problem, parent, backend, 0.0)
    msgs = tr.messages(st)
    samples = tr.sample_group(st, msgs, 4)
    tr.score_group(st, samples)
    loss, kl = tr.loss(msgs, samples)
    # The adapter starts at zero (LoRA's B = 0): the policy is the base, so the KL estimate is 0.
    if loss is not None:
        assert math.isfinite(float(loss)) and abs(kl) < 1e-5


@pytest.mark.parametrize("argv, message", [
    (["--train-shapes", "1024x1024"], "--train-shapes: expected MxNxK"),
    (["--train-shapes", "1024x1024x1024", "--held-shapes", "1024x1024x1024"], "also a training shape"),
    (["--train-shapes", "1024x1024x1024", "--group", "1"], "--group must be >= 2"),
    (["--train-shapes", "1024x1024x1024", "--scoring", "median"], "--scoring 'median': expected one of mean, sum"),
    (["--train-shapes", "1024x1024x1024", "--model", "/nonexistent/model.gguf"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_1(argv, message, tmp_path, capsys):
    from l2ir.cli import main

    rc = main(["train-policy", "--db", str(tmp_path / "r.db"), "--standin"] + argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and message in err and len(err.splitlines()) == 1, err


def test_without_a_gpu_and_no_standin_it_says_what_to_do(tiny_model, tmp_path, capsys):
    from l2ir.cli import main
    from l2ir.search.preflight import missing

    if not missing(gpu=True, toolchain=True):
        pytest.skip("this machine can measure rewards")
    rc = main(["train-policy", "--db", str(tmp_path / "r.db"), "--model", str(tiny_model),
               "--train-shapes", "1024x1024x1024"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "--standin" in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------------------------
# On the GPU: measured rewards through the pipeline (raw-PTX backends), repeats answered by the records DB.
# About a minute on an H200 (a dozen nvcc builds in parallel, then ~1 s of gates and timing per kernel):
#     python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_train_policy.py
# ---------------------------------------------------------------------------------------------------------------


def _gpu_skip():
    from test_evaluator_gpu import SKIP

    return SKIP


@pytest.mark.gpu
def test_on_the_gpu_rewards_are_measured_and_repeats_cost_no_gpu_time(tiny_model, tmp_path):
    if _gpu_skip():
        pytest.skip(_gpu_skip())
    from l2ir.policy.train import Rewarder, make_rewarder, options, parse_shapes, run_training, start_kernel
    from l2ir.search.db import RecordsDB

    summary = run_training(_args(tmp_path, tiny_model, standin=False, device="cuda", steps=1, group=4, no_exact=True,
                                 train_shapes=["1024x1024x1024"], held_shapes=["2048x2048x1024"]),
                           log=print)
    before = summary["before"]
    assert summary["rewards"] == "measured on the GPU" and before["valid_rate"] == 1.0
    assert summary["config"]["scoring"] == "mean"     # the default, recorded with the run
    assert before["measured_proposals"] > 0 and 0.05 < before["geomean_speedup"] < 20, before
    db = RecordsDB(tmp_path / "r.db")
    outcomes = [o for c in db.llm_calls() for o in c["outcomes"]]
    assert any(o["verdict"] == "measured" and o["speedup"] > 0 for o in outcomes)
    assert summary["rewarder"]["evaluated"] >= 1 and summary["rewarder"]["gpu_s"] > 0
    # A fresh rewarder on the same DB answers every kernel measured above from the records: no GPU time.
    problem, = parse_shapes(["2048x2048x1024"], "test")
    parent, backend = start_kernel(problem, "sm90a")
    children = [(parent, backend)]
    rewarder, ev = make_rewarder(False, db, 0, -1.0)
    try:
        first = rewarder(problem, children)
        assert rewarder.evaluated == 0 and rewarder.reused == 1 and first[0].verdict in ("measured", "failed")
        assert isinstance(rewarder, Rewarder) and options(parent, problem, "sm90a", backend)
    finally:
        ev.close()
