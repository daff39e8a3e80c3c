"""The learned policy: legal and deterministic proposals, a state that round-trips through JSON, updates that move
it toward rewarded edits, and, trained on a synthetic reward (a deterministic cost model, test_policy.py), fewer
evaluations than random edits to reach a speedup on problems it never saw."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l2ir.nodes import Problem
from l2ir.policy.actions import ACTIONS, Action, apply_action, diff_edits
from l2ir.policy.base import Context, Feedback, Measured, Proposal
from l2ir.policy.episodes import climb
from l2ir.policy.random_edits import RandomEdits
from l2ir.seed import seed
from l2ir.testing import problems
from test_policy import ARCHS, _check_proposals, run_in_loop, synthetic_speedup

torch = pytest.importorskip("torch")
from l2ir.policy.learned import Learned  # noqa: E402




@settings(max_examples=40, deadline=None)
@given(problems(max_dim=8192), ARCHS, st.integers(0, 2 ** 20))
def test_learned_proposals_are_legal(problem, arch, s):
    ctx = Context(problem, seed(problem, arch), seed=s, count=6)
    _check_proposals(ctx, Learned(seed=1).propose(ctx))


def test_learned_is_deterministic_and_its_state_round_trips():
    p = Problem(2048, 1024, 1024)
    pol = Learned(seed=3)
    c = climb(pol, p, synthetic_speedup, seed(p, "sm80"), budget=24, seed=1)
    assert pol.updates > 0
    twin = Learned(seed=3)
    c2 = climb(twin, p, synthetic_speedup, seed(p, "sm80"), budget=24, seed=1)
    assert c.curve == c2.curve
    state = pol.state_dict()
    blob = json.dumps(state)                  # JSON-able, so the records DB can store it
    loaded = Learned.from_state(json.loads(blob))
    again = Learned(seed=99)
    again.load_state_dict(blob.encode())
    q = Problem(512, 4096, 2048)
    ctx = Context(q, seed(q, "sm90a"), Measured(speedup=0.8), seed=5, count=8)
    want = [x.text() for x in pol.propose(ctx)]
    assert want == [x.text() for x in loaded.propose(ctx)] == [x.text() for x in again.propose(ctx)]
    assert json.dumps(loaded.state_dict()) == blob
    untrained = Learned(seed=3)
    assert [x.text() for x in untrained.propose(ctx)] != want
    with pytest.raises(ValueError, match="feature set"):
        Learned().load_state_dict(dict(state, state_dim=state["state_dim"] + 1))
    with pytest.raises(ValueError, match="not a learned-policy state"):
        Learned().load_state_dict({"policy": "random"})


def test_a_state_saved_before_an_action_was_added_keeps_what_it_learned():
    """A state from a smaller action space (here: saved before the last action existed, its heads one row short)
    loads: every action it knows keeps its learned rows, weights and Adam moments alike; the added action starts
    where a fresh policy starts it (the random policy's prior); the shared layers load as saved."""
    from l2ir.policy.learned import _decode

    p = Problem(2048, 1024, 1024)
    pol = Learned(seed=4)
    climb(pol, p, synthetic_speedup, seed(p, "sm80"), budget=16, seed=2)
    state = json.loads(json.dumps(pol.state_dict()))
    old = dict(state, actions=state["actions"][:-1],
               weights={k: (_encode_rows(_decode(v)[:-1]) if k.startswith(("policy.", "value.")) else v)
                        for k, v in state["weights"].items()})
    old["optimizer"] = {i: {key: (_encode_rows(_decode(v)[:-1]) if _decode(v).ndim and int(i) >= 4 else v)
                            for key, v in st.items()} for i, st in state["optimizer"].items()}
    fresh = Learned(seed=4)
    loaded = Learned(seed=4)
    loaded.load_state_dict(old)
    got, want, new = loaded.state_dict(), state, fresh.state_dict()
    for name in want["weights"]:
        w, g = _decode(want["weights"][name]), _decode(got["weights"][name])
        if name.startswith(("policy.", "value.")):
            np.testing.assert_array_equal(g[:-1], w[:-1])
            np.testing.assert_array_equal(g[-1], _decode(new["weights"][name])[-1])
        else:
            np.testing.assert_array_equal(g, w)
    moments = _decode(got["optimizer"]["4"]["exp_avg"])    # the policy head's weight: the added row starts at zero
    assert not moments[-1].any()
    np.testing.assert_array_equal(moments[:-1], _decode(state["optimizer"]["4"]["exp_avg"])[:-1])


@pytest.mark.parametrize("width", [46, 47, 48])
def test_a_state_saved_before_a_feature_was_added_keeps_what_it_learned(width):
    """A state from before the features had names (no "features"), from before the cluster-reduction (46 inputs),
    repack (47) or interleave (48) input existed, loads: each known feature's column of the first layer and its Adam
    moments are copied, an added feature's column starts at zero, so the loaded policy proposes exactly what the old
    one did on a kernel where the added features are 0; a state whose features this version does not know at all is
    refused."""
    from l2ir.policy.features import STATE_FEATURES, UNNAMED_FEATURES, state_features
    from l2ir.policy.learned import INPUT_WEIGHT, _decode

    p = Problem(2048, 1024, 1024)
    pol = Learned(seed=4)
    climb(pol, p, synthetic_speedup, seed(p, "sm80"), budget=16, seed=2)
    state = json.loads(json.dumps(pol.state_dict()))
    gone = [j for j, f in enumerate(STATE_FEATURES) if f not in UNNAMED_FEATURES[width]]
    assert len(STATE_FEATURES) - len(gone) == width

    def without_columns(v):
        return _encode_rows(np.delete(_decode(v), gone, axis=1))

    old = {k: v for k, v in state.items() if k != "features"}
    old["state_dim"] = width
    old["weights"] = dict(state["weights"], **{INPUT_WEIGHT: without_columns(state["weights"][INPUT_WEIGHT])})
    old["optimizer"] = dict(state["optimizer"], **{"0": {key: (without_columns(v) if _decode(v).ndim else v)
                                                         for key, v in state["optimizer"]["0"].items()}})
    loaded = Learned(seed=9)
    loaded.load_state_dict(old)
    got = loaded.state_dict()
    w, g = _decode(state["weights"][INPUT_WEIGHT]), _decode(got["weights"][INPUT_WEIGHT])
    np.testing.assert_array_equal(np.delete(g, gone, axis=1), np.delete(w, gone, axis=1))
    assert not g[:, gone].any() and not _decode(got["optimizer"]["0"]["exp_avg"])[:, gone].any()
    q = Problem(512, 4096, 2048)
    ctx = Context(q, seed(q, "sm90a"), Measured(speedup=0.8), seed=5, count=8)
    assert not state_features(q, ctx.parent, ctx.num_sms, None, 0.0)[gone].any()
    assert [x.text() for x in loaded.propose(ctx)] == [x.text() for x in pol.propose(ctx)]
    with pytest.raises(ValueError, match="shares no input feature"):
        Learned().load_state_dict(dict(state, features=[f"other.{f}" for f in state["features"]]))


def test_every_feature_has_its_name():
    """The state vector and the names line up (a feature added without its name would shift every later name), and
    the interleave feature sees the node."""
    from l2ir.policy.features import STATE_DIM, STATE_FEATURES, state_features
    from l2ir.policy.rules import interleave_decode_kernel

    p = Problem(17, 9999, 3333)
    at = STATE_FEATURES.index("kernel.interleave")
    for kernel, want in ((seed(p, "sm80"), 0.0), (interleave_decode_kernel(p, "sm80", 3), 1.0),
                         (seed(Problem(4096, 4096, 4096), "sm90a"), 0.0)):
        v = state_features(p, kernel, 132, None, 0.1)
        assert v.shape == (STATE_DIM,) and len(set(STATE_FEATURES)) == STATE_DIM and v[at] == want
        assert v[STATE_FEATURES.index("parent.measured")] == 1.0


def test_the_committed_learned_states_load():
    """The states bench/policy_compare.py wrote load into this version: the H200 one of 2026-11 (46 unnamed inputs:
    before the cluster-reduction, repack and interleave features) with each known input's column as saved and the
    others at zero, a named one exactly as saved."""
    from l2ir.policy.features import STATE_FEATURES, UNNAMED_FEATURES
    from l2ir.policy.learned import INPUT_WEIGHT, _decode

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    widths = []
    for path in sorted(results.glob("policy_compare_*_learned_state.json")):
        state = json.loads(path.read_text())
        got = _decode(Learned.from_state(state).state_dict()["weights"][INPUT_WEIGHT])
        saved = _decode(state["weights"][INPUT_WEIGHT])
        names = state.get("features") or UNNAMED_FEATURES[state["state_dim"]]
        for j, feature in enumerate(STATE_FEATURES):
            if feature in names:
                np.testing.assert_array_equal(got[:, j], saved[:, list(names).index(feature)])
            else:
                assert not got[:, j].any(), (path.name, feature)
        widths.append((path.name, state["state_dim"], "features" in state))
    assert ("policy_compare_h200_s0_learned_state.json", 46, False) in widths, widths


def _encode_rows(arr):
    import torch

    from l2ir.policy.learned import _encode

    return _encode(torch.from_numpy(np.ascontiguousarray(arr)))


def test_a_restored_learned_policy_keeps_learning_as_the_original():
    """The saved state carries the optimizer's moments: after the same updates, the restored policy and the original
    hold the same weights (without the moments, Adam's first step after a restore differs)."""
    p = Problem(2048, 1024, 1024)
    pol = Learned(seed=4)
    climb(pol, p, synthetic_speedup, seed(p, "sm80"), budget=16, seed=2)
    assert pol.updates > 0 and pol.state_dict()["optimizer"]
    restored = Learned.from_state(json.loads(json.dumps(pol.state_dict())))
    q = Problem(512, 4096, 2048)
    for twin in (pol, restored):
        climb(twin, q, synthetic_speedup, seed(q, "sm80"), budget=16, seed=7)
    assert json.dumps(pol.state_dict()["weights"]) == json.dumps(restored.state_dict()["weights"])


def test_learned_update_moves_toward_rewarded_actions():
    p = Problem(4096, 4096, 4096)
    ctx = Context(p, seed(p, "sm80"), Measured(speedup=0.5), seed=0, count=8)
    pol = Learned(seed=0, oversample=1)
    idx = ACTIONS.index(Action("rules", "sm90a"))

    def prob():
        mask, _ = pol._legal(ctx)
        with torch.no_grad():
            logits, _ = pol._heads(pol._state(ctx)[None])
        logits = logits[0].masked_fill(~torch.from_numpy(mask), -1e9)
        return float(torch.softmax(logits, 0)[idx])

    before = prob()
    child, backend = apply_action(ctx.parent, p, Action("rules", "sm90a"))
    prop = Proposal(edits=diff_edits(ctx.parent, child), backend=backend)
    for _ in range(20):    # a proposal it did not make itself is recognised as the action it is
        pol.update([Feedback(ctx, prop, "measured", reward=math.log(1.0))])
    assert prob() > 2 * before


def _train_and_compare(train_shapes, held_shapes, epochs, budget, seeds):
    pol = Learned(seed=0)
    for ep in range(epochs):
        for i, s in enumerate(train_shapes):
            p = Problem(*s)
            climb(pol, p, synthetic_speedup, seed(p, "sm80"), budget=40, seed=ep * 100 + i)
    needed = {"learned": [], "random": []}
    for s in held_shapes:
        p = Problem(*s)
        start = seed(p, "sm80")
        # The target: 97% of what a long random search finds on this problem.
        target = 0.97 * climb(RandomEdits(), p, synthetic_speedup, start, budget=300, seed=999).curve[-1]
        for name, policy in (("learned", pol), ("random", RandomEdits())):
            for sd in seeds:
                c = climb(policy, p, synthetic_speedup, start, budget=budget, seed=sd, target=target, learn=False)
                e = c.evaluations_to(target)
                needed[name].append(budget + 1 if e is None else e)
    return {k: float(np.mean(v)) for k, v in needed.items()}


def test_learned_reaches_the_target_in_fewer_evaluations_than_random_on_unseen_shapes():
    grid = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    rng = np.random.default_rng(0)
    shapes = [tuple(int(x) for x in rng.choice(grid, 3)) for _ in range(34)]
    train, held = shapes[:24], shapes[24:]
    assert not set(train) & set(held)
    mean = _train_and_compare(train, held, epochs=3, budget=60, seeds=(0, 1))
    # Random edits need about 37 evaluations here; the policy trained from init seed 0 about 22 (seed 2: 25; an
    # untrained one 39), measured when this was written.
    assert mean["learned"] < 0.85 * mean["random"], mean


def test_learned_drives_the_search_loop_on_the_standin(tmp_path):
    run_in_loop("learned", tmp_path)
