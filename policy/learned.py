"""A policy learned by reinforcement learning from measured rewards (REINFORCE with a baseline), in torch on the CPU.

The action space is the flat list of edit operators `policy.actions.ACTIONS` (frozen (knob, value) records over
the whole IR and every backend). A small MLP reads the state (problem features: log M, N, K, FLOPs, aspect ratios,
divisibility, tiles per SM; kernel features: tile, stages, schedule, split-K, cluster, repack, interleave, epilogue,
padding, backend, waves and last-wave fill on this problem; the parent's measured log speedup) and gives
  - a policy head: logits over the actions, masked to those that make a legal, new child for this problem;
  - a cost-model head: the predicted reward of each action from this state, trained by regression on every
    outcome, used to rank a larger sample before anything is compiled or timed (as TVM's cost model does).

propose() draws `count * oversample` distinct actions from the masked softmax (Gumbel top-k with noise from the
context's seeded generator), keeps the `count` the cost model ranks highest, and returns each as edits with a note.
update() turns each outcome into a reward: the log speedup gained over the parent (0 for a loss or a gain within
`min_gain`, the timing noise; log speedup alone when the parent was never measured), or `penalty` for an illegal
or failed candidate; the policy gradient uses (reward - running baseline). state_dict() is JSON (weights as base64
float32), so the records DB stores it and a later run, on other shapes, starts from it; so does a later version of
L2IR with more actions or input features (the state names both). Everything is deterministic for a seed.
"""

from __future__ import annotations

import base64
import contextlib
import math
from typing import Any

import numpy as np

from .actions import ACTIONS, KNOBS, diff_edits, legal_children
from .base import Context, Dedupe, Feedback, Proposal
from .features import STATE_DIM, STATE_FEATURES, UNNAMED_FEATURES, state_features

STATE_VERSION = 1
INPUT_WEIGHT = "net.0.weight"      # the only parameter with a column per input feature


@contextlib.contextmanager
def _one_thread():
    """The MLP is tiny: one thread runs it in well under a millisecond, while torch's thread pool spends tens of
    milliseconds waking workers on a loaded CPU. The caller's setting is restored afterwards."""
    torch = _torch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("the learned policy needs torch (pip install torch; the CPU build is enough)") from None
    return torch


class Learned:
    name = "learned"

    # Learning rate 0.003: on the stand-in model, 48 of 50 training runs (initial-weights seeds, two disjoint splits
    # of held-out shapes, 240 or 2,736 updates) ended ahead of random edits, against 35 of 50 at 0.01, whose runs
    # fall into a good or a poor mode by their initial weights (bench/results/policy_compare_standin_training.json).
    def __init__(self, seed: int = 0, hidden: int = 64, lr: float = 0.003, penalty: float = -0.5,
                 baseline_decay: float = 0.9, oversample: int = 2, temperature: float = 1.0,
                 entropy: float = 0.01, min_gain: float = 0.02):
        if hidden < 1 or lr <= 0 or oversample < 1 or temperature <= 0:
            raise ValueError(f"Learned: hidden, lr, oversample and temperature must be positive "
                             f"(got hidden={hidden} lr={lr} oversample={oversample} temperature={temperature})")
        torch = _torch()
        self.seed, self.hidden, self.lr, self.penalty = seed, hidden, lr, penalty
        self.baseline_decay, self.oversample, self.temperature, self.entropy = (baseline_decay, oversample,
                                                                                temperature, entropy)
        self.min_gain = min_gain
        gen = torch.Generator().manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(STATE_DIM, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
        self.policy_head = torch.nn.Linear(hidden, len(ACTIONS))
        self.value_head = torch.nn.Linear(hidden, len(ACTIONS))
        with torch.no_grad():
            for mod in self.modules():
                if isinstance(mod, torch.nn.Linear):
                    bound = 1 / math.sqrt(mod.in_features)
                    mod.weight.copy_(torch.rand(mod.weight.shape, generator=gen) * 2 * bound - bound)
                    mod.bias.zero_()
            # Start as the random policy (a knob uniformly, then one of its values) with no opinion on rewards.
            self.policy_head.weight.mul_(0.01)
            self.policy_head.bias.copy_(torch.tensor([-math.log(len(KNOBS[a.knob])) for a in ACTIONS]))
            self.value_head.weight.mul_(0.01)
        self.opt = torch.optim.Adam(self.parameters(), lr=lr)
        self.baseline = 0.0
        self.updates = 0
        self._pending: dict[tuple, tuple[np.ndarray, np.ndarray, int]] = {}
        self._legal_cache: dict[tuple, tuple[np.ndarray, list]] = {}

    # -- torch plumbing ------------------------------------------------------------------------------------------

    def modules(self):
        return [*self.net, self.policy_head, self.value_head]

    def parameters(self):
        return [p for mod in (self.net, self.policy_head, self.value_head) for p in mod.parameters()]

    def _named(self) -> dict[str, Any]:
        out = {}
        for prefix, mod in (("net", self.net), ("policy", self.policy_head), ("value", self.value_head)):
            for name, p in mod.named_parameters():
                out[f"{prefix}.{name}"] = p
        return out

    def _heads(self, states: np.ndarray):
        torch = _torch()
        h = self.net(torch.from_numpy(states))
        return self.policy_head(h), self.value_head(h)

    # -- the protocol --------------------------------------------------------------------------------------------

    def _legal(self, context: Context) -> tuple[np.ndarray, list]:
        """Mask of the actions that make a legal child other than the parent, and the children. A search comes
        back to the same parent many times, so the answer is kept (for the last few hundred parents)."""
        key = (context.problem, context.parent, context.arch, context.backend)
        hit = self._legal_cache.get(key)
        if hit is None:
            hit = self._legal_cache[key] = self._legal_uncached(context)
            while len(self._legal_cache) > 512:
                self._legal_cache.pop(next(iter(self._legal_cache)))
        return hit

    def _legal_uncached(self, context: Context) -> tuple[np.ndarray, list]:
        seen = Dedupe(context.parent, context.backend)
        mask = np.zeros(len(ACTIONS), dtype=bool)
        children: list = [None] * len(ACTIONS)
        for i, _, kernel, backend in legal_children(context.parent, context.problem, context.arch, context.backend,
                                                    seen):
            mask[i] = True
            children[i] = (kernel, backend)
        return mask, children

    def _state(self, context: Context) -> np.ndarray:
        return state_features(context.problem, context.parent, context.num_sms, context.backend,
                              context.parent_reward)

    @staticmethod
    def _key(context: Context, proposal: Proposal) -> tuple:
        return (context.problem, context.parent.content_hash(), context.backend, context.arch, context.num_sms,
                proposal.text(), proposal.backend)

    def propose(self, context: Context) -> list[Proposal]:
        torch = _torch()
        mask, children = self._legal(context)
        seen = Dedupe.of(context)
        mask = mask & np.array([m and seen.fresh(*children[i]) for i, m in enumerate(mask)], dtype=bool)
        if not mask.any():
            return []
        state = self._state(context)
        with torch.no_grad(), _one_thread():
            logits, values = self._heads(state[None])
        logits = logits[0].numpy().astype(np.float64) / self.temperature
        values = values[0].numpy().astype(np.float64)
        logits[~mask] = -np.inf
        probs = np.exp(logits - logits[mask].max())
        probs /= probs.sum()
        # Gumbel top-k: k distinct draws from the softmax, reproducible from the context's seed.
        gumbel = context.rng(salt=2).gumbel(size=len(ACTIONS))
        order = np.argsort(-(logits + gumbel), kind="stable")
        drawn = [int(i) for i in order[: min(int(mask.sum()), context.count * self.oversample)]]
        # The cost model ranks the draws; ties keep the draw order.
        ranked = sorted(drawn, key=lambda i: -values[i]) if self.oversample > 1 else drawn
        out = []
        for i in ranked[: context.count]:
            kernel, backend = children[i]
            edits = diff_edits(context.parent, kernel)
            note = f"learned: {ACTIONS[i]} (p={probs[i]:.3f}, predicted reward {values[i]:+.3f})"
            prop = (Proposal(edits=edits, note=note, backend=backend) if edits
                    else Proposal(kernel=kernel, note=note, backend=backend))
            self._pending[self._key(context, prop)] = (state, mask, i)
            out.append(prop)
        return out

    def _recall(self, fb: Feedback) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The state, mask and action behind a proposal: remembered from propose(), or worked out again (after a
        reload, or for a proposal another policy made that is one action away)."""
        hit = self._pending.pop(self._key(fb.context, fb.proposal), None)
        if hit is not None:
            return hit
        mask, children = self._legal(fb.context)
        try:
            target = fb.proposal.apply(fb.context.parent, fb.context.problem, lowerable=False)
        except Exception:   # noqa: BLE001 - an illegal proposal of another policy: nothing to learn from here
            return None
        for i, made in enumerate(children):
            if made is not None and made[0] == target and made[1] == fb.proposal.backend:
                return self._state(fb.context), mask, i
        return None

    def reward_of(self, fb: Feedback) -> float:
        if fb.verdict != "measured":
            return self.penalty
        base = fb.context.parent_reward
        if base is None:
            return fb.reward
        # A search keeps its best kernel, so a worse child costs only its evaluation: the gain, floored at 0. Gains
        # within the timing noise (a few percent on a GPU) teach nothing but the noise, so they count as none.
        gain = fb.reward - base
        return gain if gain > self.min_gain else 0.0

    def update(self, feedback: list[Feedback]) -> None:
        rows = []
        for fb in feedback:
            got = self._recall(fb)
            if got is not None:
                rows.append((*got, self.reward_of(fb)))
        if not rows:
            return
        with _one_thread():
            self._step(rows)
        self.updates += 1

    def _step(self, rows) -> None:
        torch = _torch()
        states = np.stack([r[0] for r in rows])
        masks = torch.from_numpy(np.stack([r[1] for r in rows]))
        acts = torch.tensor([r[2] for r in rows])
        rewards = torch.tensor([r[3] for r in rows], dtype=torch.float32)
        logits, values = self._heads(states)
        logits = logits.masked_fill(~masks, -1e9)
        logp = torch.log_softmax(logits, dim=1)
        chosen = logp.gather(1, acts[:, None])[:, 0]
        adv = rewards - self.baseline
        probs = logp.exp()
        ent = -(probs * logp.masked_fill(~masks, 0.0)).sum(1).mean()
        pred = values.gather(1, acts[:, None])[:, 0]
        loss = -(adv * chosen).mean() - self.entropy * ent + ((pred - rewards) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.baseline = self.baseline_decay * self.baseline + (1 - self.baseline_decay) * float(rewards.mean())

    # -- persistence ---------------------------------------------------------------------------------------------

    def config(self) -> dict:
        return {"seed": self.seed, "hidden": self.hidden, "lr": self.lr, "penalty": self.penalty,
                "baseline_decay": self.baseline_decay, "oversample": self.oversample,
                "temperature": self.temperature, "entropy": self.entropy, "min_gain": self.min_gain}

    def state_dict(self) -> dict:
        weights = {name: _encode(p) for name, p in self._named().items()}
        # Adam's moments are part of the learner: a policy resumed without them takes different steps from the
        # uninterrupted one after its next update.
        moments = {str(i): {key: _encode(v) for key, v in st.items()}
                   for i, st in self.opt.state_dict()["state"].items()}
        return {"policy": self.name, "version": STATE_VERSION, "config": self.config(),
                "actions": [str(a) for a in ACTIONS], "features": list(STATE_FEATURES), "state_dim": STATE_DIM,
                "weights": weights, "optimizer": moments, "baseline": self.baseline, "updates": self.updates}

    def load_state_dict(self, state: dict | bytes) -> None:
        torch = _torch()
        if isinstance(state, (bytes, bytearray)):
            import json

            state = json.loads(state)
        if state.get("policy") != self.name or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a learned-policy state of version {STATE_VERSION}: policy={state.get('policy')!r} "
                             f"version={state.get('version')!r}")
        # A feature set that grew (a new IR choice the state now shows) keeps what was learned too: the first
        # layer's column of a feature the state knows is copied, a new feature's column starts at zero (no say in
        # what was learned until updates give it one; zero Adam moments), a feature this version dropped is dropped.
        saved_features = state.get("features") or list(UNNAMED_FEATURES.get(state["state_dim"], ()))
        if len(saved_features) != state["state_dim"]:
            raise ValueError(f"the saved learned policy was trained on {state['state_dim']} input features, "
                             f"{len(saved_features)} of them named: a feature set this version of L2IR cannot place")
        features = list(STATE_FEATURES)
        where = {f: i for i, f in enumerate(saved_features)}
        cols = None if saved_features == features else [(j, where[f]) for j, f in enumerate(features) if f in where]
        if cols == []:
            raise ValueError("the saved learned policy shares no input feature with this version of L2IR")
        if state["config"]["hidden"] != self.hidden:
            raise ValueError(f"saved hidden={state['config']['hidden']} but this policy has hidden={self.hidden}")
        # An action space that grew (a new IR choice became an edit) keeps what was learned: each head's row of an
        # action the state knows is copied, a new action keeps its fresh row (the random policy's prior, no opinion
        # on its reward; zero Adam moments), an action this version no longer has is dropped. Only the heads have
        # rows per action and only the input layer columns per feature; everything else loads as saved. Adam's step
        # count loads as saved too, so a new row's or column's first updates are larger than a fresh policy's (its
        # zero moments get no bias correction left): a few times the learning rate for its first tens of updates.
        actions = [str(a) for a in ACTIONS]
        known = {a: i for i, a in enumerate(state["actions"])}
        rows = None if state["actions"] == actions else [(j, known[a]) for j, a in enumerate(actions) if a in known]
        if rows == []:
            raise ValueError("the saved learned policy shares no action with this version of L2IR")
        named = self._named()

        def placed(name: str, spec: dict, fresh):
            saved = torch.from_numpy(_decode(spec))
            if saved.ndim == 0:
                return saved
            if rows is not None and name.startswith(("policy.", "value.")):
                out = fresh.detach().clone()
                for j, i in rows:
                    out[j] = saved[i]
                return out
            if cols is not None and name == INPUT_WEIGHT:
                out = torch.zeros_like(fresh)
                for j, i in cols:
                    out[:, j] = saved[:, i]
                return out
            return saved

        with torch.no_grad():
            for name, spec in state["weights"].items():
                named[name].copy_(placed(name, spec, named[name]))
        # States saved before the moments were kept load with fresh ones.
        opt_state = self.opt.state_dict()
        params = list(named.items())
        opt_state["state"] = {int(i): {key: placed(params[int(i)][0], spec, torch.zeros_like(params[int(i)][1]))
                                       for key, spec in st.items()}
                              for i, st in state.get("optimizer", {}).items()}
        self.opt.load_state_dict(opt_state)
        self.baseline = float(state["baseline"])
        self.updates = int(state["updates"])

    @classmethod
    def from_state(cls, state: dict | bytes) -> "Learned":
        if isinstance(state, (bytes, bytearray)):
            import json

            state = json.loads(state)
        pol = cls(**state["config"])
        pol.load_state_dict(state)
        return pol


def _encode(tensor) -> dict:
    """A float32 tensor as JSON: shape and base64 of its little-endian bytes."""
    arr = tensor.detach().cpu().numpy().astype("<f4")
    return {"shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}


def _decode(spec: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(spec["data"]), dtype="<f4").reshape(spec["shape"]).copy()
