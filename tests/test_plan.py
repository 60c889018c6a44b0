"""train/plan.py and ``specdec plan``: the law's fit, the recommendation, the command on tiny drafts."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import invoke

from specdec.train import plan
from specdec.train.loop import config_from_dict


def sig(z):
    return 1 / (1 + math.exp(-z))


# ---------------------------------------------------------------------------------------------
# The fit


def test_fit_recovers_a_known_sigmoid_law():
    alpha, beta, gamma = -4.0, 0.3, 0.12
    rng = random.Random(0)
    points = [(n, d, sig(alpha + beta * math.log(n) + gamma * math.log(d)) + rng.gauss(0, 2e-4))
              for n in (2e5, 8e5, 3.2e6, 1.28e7) for d in (1e6, 1e7, 1e8)]
    law = plan.fit_law(points)
    assert law.fixed == {}
    assert law.alpha == pytest.approx(alpha, abs=0.05)
    assert law.beta == pytest.approx(beta, abs=0.005)
    assert law.gamma == pytest.approx(gamma, abs=0.005)
    assert law.rmse < 5e-4
    for n, d in ((5e7, 3e8), (1e5, 2e6)):  # beyond the points: the law, not the points, is what was recovered
        assert law.predict(n, d) == pytest.approx(sig(alpha + beta * math.log(n) + gamma * math.log(d)), abs=2e-3)


def test_fit_log_linear_and_what_cannot_be_identified():
    pts = [(n, d, 0.1 + 0.03 * math.log(n) + 0.01 * math.log(d)) for n in (1e5, 1e6, 1e7) for d in (1e6, 1e8)]
    law = plan.fit_law(pts, "log-linear")
    assert (law.alpha, law.beta, law.gamma) == pytest.approx((0.1, 0.03, 0.01), abs=1e-9)
    assert law.predict(1e30, 1e30) == 1 - plan.EPS  # clipped to (0, 1)

    # equal budgets: the larger draft saw fewer tokens; two points fit alpha and beta, gamma stays at its prior
    two = [(1e5, 4e6, 0.55), (1e6, 1e6, 0.65)]
    law = plan.fit_law(two)
    assert set(law.fixed) == {"gamma"} and "cannot fit three" in law.fixed["gamma"]
    assert law.gamma == plan.PRIORS["sigmoid"]["gamma"]
    assert [law.predict(n, d) for n, d, _ in two] == pytest.approx([0.55, 0.65], abs=1e-6)  # exact through both

    # three points whose sizes and tokens move together: not told apart either
    line = [(10.0 ** e, 10.0 ** (8 - e), 0.5 + 0.05 * e) for e in (4, 5, 6)]
    assert "vary together" in plan.fit_law(line).fixed["gamma"]

    one = plan.fit_law([(1e6, 1e7, 0.6)])
    assert set(one.fixed) == {"beta", "gamma"} and one.predict(1e6, 1e7) == pytest.approx(0.6, abs=1e-6)
    with pytest.raises(plan.SpecdecError):
        plan.fit_law([(0, 1e6, 0.5)])


def test_training_rate_sizes_and_ladder():
    rate = plan.fit_rate([(1e5, 1000, 1e-3 * 1000 + 2e-8 * 1e5 * 1000), (1e6, 500, 1e-3 * 500 + 2e-8 * 1e6 * 500)])
    assert (rate.s0, rate.s1) == pytest.approx((1e-3, 2e-8))
    assert rate.tokens(1e5, 60) == pytest.approx(60 / (1e-3 + 2e-3))
    assert plan.fit_rate([(1e5, 100, 2.0)]).s0 == 0  # one size: proportional

    assert plan.parse_sizes("layers=1,hidden=32,heads=4,layers=2,hidden=64,heads=4") == \
        ["layers=1,hidden=32,heads=4", "layers=2,hidden=64,heads=4"]
    assert plan.parse_sizes("layers=1,hidden=32; layers=2") == ["layers=1,hidden=32", "layers=2"]
    lad = plan.ladder([{"layers": 1, "hidden": 32, "heads": 4}, {"layers": 4, "hidden": 128, "heads": 4}])
    keys = [(a["layers"], a["hidden"], a["heads"]) for a in lad]
    assert keys == [(1, 16, 2), (1, 32, 4), (2, 64, 8), (4, 128, 4), (4, 256, 8)]


# ---------------------------------------------------------------------------------------------
# The recommendation


def test_recommend_picks_the_analytic_best():
    law = plan.Law("sigmoid", alpha=-7.0, beta=0.45, gamma=0.1)
    n_target = 5e7
    sizes = [3e5, 1e6, 3e6, 1e7, 3e7]
    verify = {w: 1 + 0.06 * (w - 1) for w in range(1, plan.K_MAX + 2)}  # a CPU-like slope per extra token

    def tokens(n):  # a 30-minute budget at 2e-9 s per token per parameter plus 1e-5 s per token
        return 1800 / (1e-5 + 2e-9 * n)

    cands = [plan.Candidate(f"n{int(n)}", int(n), draft_cost=0.6 * n / n_target) for n in sizes]
    got = plan.recommend(cands, law, verify, tokens)

    # independently: every (size, k), E = sum of a^i for i = 0..k, cost = k drafts + a verify of k + 1 tokens
    expect = None
    for n in sizes:
        a = sig(-7.0 + 0.45 * math.log(n) + 0.1 * math.log(tokens(n)))
        for k in range(1, 9):
            s = sum(a ** i for i in range(k + 1)) / (k * 0.6 * n / n_target + 1 + 0.06 * k)
            if expect is None or s > expect[2]:
                expect = (f"n{int(n)}", k, s, a)
    best = got["best"]
    assert (best["name"], best["k"]) == expect[:2]
    assert best["speedup"] == pytest.approx(expect[2], rel=1e-9)
    assert best["acceptance"] == pytest.approx(expect[3], rel=1e-9)
    assert best["pays"] is True
    assert expect[0] not in ("n300000", "n30000000") and 1 < expect[1] < 8  # an interior optimum, not an edge
    assert len(got["rows"]) == len(sizes) and all(len(r["speedup_by_k"]) == 8 for r in got["rows"])

    # a draft as costly as the target never pays
    dear = plan.recommend([plan.Candidate("big", int(n_target), draft_cost=1.0)], law, verify, tokens)
    assert dear["best"]["pays"] is False
    assert plan.expected_tokens(1.0, 4) == 5 and plan.expected_tokens(0.5, 2) == pytest.approx(1.75)


# ---------------------------------------------------------------------------------------------
# The command


CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\npath = os.path.join('a', 'b')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]


@pytest.fixture(scope="module")
def planned(tiny_family, tmp_path_factory):
    """The tiny target, a data file, and two tiny drafts of different sizes trained a few steps each."""
    from specdec.train.trainers.draft import train_draft

    root = tmp_path_factory.mktemp("plan")
    rng = random.Random(0)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "".join(rng.choice(CODE) for _ in range(6))}) + "\n" for _ in range(60)))
    cfg = config_from_dict(dict(lr=3e-3, steps=3, batch=4, seq_len=32, warmup=1, checkpoint_every=0, progress=False,
                                heldout=0.15, save_final_checkpoint=False))
    drafts = []
    for name, arch in (("small", "layers=1,hidden=16,heads=2"), ("large", "layers=1,hidden=48,heads=4")):
        train_draft(tiny_family / "target", [data], root / name, cfg, arch=arch, kd_weight=0.5)
        drafts.append(root / name)
    return tiny_family / "target", data, drafts, root


def test_cli_plan_over_artifacts(planned):
    target, _, drafts, root = planned
    out = root / "report.json"
    res = invoke(["plan", "--target", target, "--artifacts", ",".join(map(str, drafts)), "--batch-size", "2", "--repeats", "2",
                  "--train-budget-minutes", "30", "--device", "cpu", "--threads", "1", "--out", out])
    assert res.exit_code == 0, res.output
    assert "recommendation: draft" in res.stdout and "draft length k=" in res.stdout
    report = json.loads(out.read_text())
    assert report["kind"] == "plan" and report["batch_size"] == 2 and report["points_from"] == "artifacts"
    assert [p["name"] for p in report["points"]] == ["small", "large"]
    metrics = [json.loads((d / "metrics.json").read_text()) for d in drafts]
    assert [p["acceptance"] for p in report["points"]] == [m["top1_agreement"] for m in metrics]
    assert [p["parameters"] for p in report["points"]] == [m["parameters"] for m in metrics]
    assert set(report["law"]["fixed"]) == {"gamma"} and any("gamma fixed" in n for n in report["notes"])
    assert report["train_budget_minutes"] == 30
    assert sorted(report["costs"]["verify"], key=int) == [str(w) for w in range(1, 10)] and report["costs"]["verify"]["1"] == 1
    names = [c["name"] for c in report["candidates"]]
    assert {"small", "large"} <= set(names) and len(names) > 2  # the ladder between and around them
    best = report["best"]
    assert best["name"] in names and 1 <= best["k"] <= 8
    row = next(c for c in report["candidates"] if c["name"] == best["name"])
    assert best["speedup"] == pytest.approx(max(row["speedup_by_k"].values()))
    assert best["speedup"] == max(c["best_speedup"] for c in report["candidates"])
    # the reported S is the formula over the reported acceptance and measured costs
    a, k, c = row["acceptance"], best["k"], row["draft_cost"]
    assert best["speedup"] == pytest.approx((1 - a ** (k + 1)) / (1 - a) / (k * c + report["costs"]["verify"][str(k + 1)]))


def test_cli_plan_trains_quick_drafts(planned):
    target, data, _, root = planned
    res = invoke(["plan", "--target", target, "--data", data, "--sizes", "layers=1,hidden=16,heads=2;layers=1,hidden=32,heads=4",
                  "--max-steps", "2", "--repeats", "1", "--device", "cpu", "--threads", "1", "--drafts-dir", root / "quick",
                  "--out", root / "quick.json"])
    assert res.exit_code == 0, res.output
    report = json.loads((root / "quick.json").read_text())
    assert report["points_from"] == "trained" and [p["arch"] for p in report["points"]] == [
        "layers=1,hidden=16,heads=2", "layers=1,hidden=32,heads=4"]
    assert all(p["train_tokens"] > 0 for p in report["points"])
    assert (root / "quick" / "draft-1" / "metrics.json").is_file()


@pytest.mark.parametrize("args, words", [
    ([], "give --data"),
    (["--artifacts", "/nonexistent/draft"], "no such folder"),
    (["--data", "x.jsonl", "--artifacts", "y"], "not both"),
    (["--artifacts", "a", "--sizes", "layers=1"], "--sizes"),
    (["--data", "/nonexistent/data.jsonl"], "no such file"),
    (["--data", "d", "--sizes", "depth=3"], "--arch"),
])
def test_cli_plan_bad_input(planned, args, words):
    target = planned[0]
    res = invoke(["plan", "--target", target, *args])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], res.stderr


def test_unmeasured_sizes_are_timed_at_the_drafts_vocabulary():
    """Sizes no point was trained at are timed as drafts of the points' vocabulary: a reduced one (a 16k draft
    vocabulary of a 262k target) costs far fewer output rows than the target's would."""
    from conftest import tiny_llama

    target = tiny_llama(vocab=300, hidden=32, layers=2, seed=0)
    full = plan.random_draft(target, "layers=1,hidden=32,heads=4")
    small = plan.random_draft(target, "layers=1,hidden=32,heads=4", vocab=40)
    assert full.get_output_embeddings().weight.shape[0] == 300
    assert small.get_output_embeddings().weight.shape[0] == small.get_input_embeddings().weight.shape[0] == 40
    # and timed on ids of its own vocabulary (the target's would index past its embedding)
    assert plan.time_model(small, plan.timing_prefix(target, 64), 2, 1, 1) > 0
