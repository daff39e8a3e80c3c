"""bench/policy_compare.py on the stand-in: the held-out shapes are never trained on, both targets are reported,
the run is reproducible, and a saved state refuses a split that would test it on its own training shapes."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("policy_compare", ROOT / "bench" / "policy_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ARGS = ["--standin", "--train-shapes", "4", "--held-shapes", "2", "--train-budget", "6", "--train-epochs", "1",
        "--budget", "6", "--seeds", "0"]


def test_policy_compare_on_the_standin(tmp_path):
    bench = _bench()
    assert bench.main(ARGS + ["--out", str(tmp_path / "a")]) == 0
    res = json.loads((tmp_path / "a.json").read_text())
    assert res["measured"] is False and "NOT measured" in (tmp_path / "a.md").read_text()
    assert not {tuple(s) for s in res["train_shapes"]} & {tuple(s) for s in res["held_shapes"]}
    assert len(res["rows"]) == 2 * 2
    for kind in ("absolute", "of_best"):
        for name in ("learned", "random"):
            s = res["summary"][kind][name]
            assert 1 <= s["mean_evaluations_to_target"] <= 7 and s["runs"] == 2
    # The of-best target is reached by whichever run found the best, so at least one run per shape reaches it.
    for shape in res["held_shapes"]:
        assert any(r["evaluations_to_target"]["of_best"] for r in res["rows"] if r["shape"] == shape)
    state = json.loads((tmp_path / "a_learned_state.json").read_text())
    assert sorted(state["trained_shapes"]) == sorted(res["train_shapes"])
    # Same command, same numbers.
    assert bench.main(ARGS + ["--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b.json").read_text())
    assert again["summary"] == res["summary"]
    # The saved state is refused where the split would hold out a shape it trained on.
    with pytest.raises(SystemExit, match="trained on held-out shape"):
        bench.main(["--standin", "--state", str(tmp_path / "a_learned_state.json"), "--train-shapes", "2",
                    "--held-shapes", "4", "--budget", "2", "--seeds", "0", "--out", str(tmp_path / "c")])
