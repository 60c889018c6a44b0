"""``specdec plan``: which draft size and draft length to train for a target, and the speedup to expect.

"Scaling laws for speculative decoding": a draft's acceptance grows log-linearly with its training
tokens and its capacity. ``plan`` measures a few drafts (quick ones trained here on ``--data`` at equal
small budgets, or existing artifacts), fits

    a(N, D) = sigmoid(alpha + beta * ln N + gamma * ln D)      (``form="sigmoid"``, the default), or
    a(N, D) = clip(alpha + beta * ln N + gamma * ln D, (0, 1))  (``form="log-linear"``)

by least squares over the points (N: the draft's parameters, D: its training tokens, a: its per-token
agreement with the target's greedy choice on held-out text, train-draft's ``top1_agreement``), and
where the points cannot identify a slope (one size only; sizes and tokens that vary together, as they
do at equal budgets; fewer points than parameters) fixes it at a prior and says so.

Costs are measured on this device, in units of the target's one-token forward at the batch size:
the target's forwards of 1..K+1 tokens per row (verification) and each candidate draft's one-token
forward (a size that was not trained is instantiated at random just to be timed). Training tokens at
``--train-budget-minutes`` come from the measured training rate (seconds per token = s0 + s1 * N,
fitted over the points). Then for every candidate size and draft length k in 1..K the expected
speedup is

    S = E[tokens per round] / (k * c_draft + c_verify(k + 1)),  E = (1 - a^(k+1)) / (1 - a)

(Leviathan et al.; the bonus token counted), and the best (size, k) is the recommendation.
Acceptance here is per row and teacher-forced; the batch size enters through the measured costs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.models.errors import SpecdecError, UsageError

K_MAX = 8
FORMS = ("sigmoid", "log-linear")
# slopes used where the points cannot identify them: per e-fold of parameters / training tokens, on the
# fit's own scale (logit for sigmoid, acceptance for log-linear); a doubling of a small draft's size
# raising its acceptance by about 0.06 around a = 0.6, of its tokens by about 0.035
PRIORS = {"sigmoid": {"beta": 0.35, "gamma": 0.2}, "log-linear": {"beta": 0.08, "gamma": 0.045}}
COLLINEAR = 0.995  # |correlation| of ln N and ln D above which their slopes are not told apart
EPS = 1e-3  # acceptance is clipped to [EPS, 1 - EPS] (logits, the log-linear form's predictions)
DEFAULT_SIZES = ("layers=1,hidden=64,heads=2", "layers=2,hidden=128,heads=4", "layers=4,hidden=256,heads=4")


# ---------------------------------------------------------------------------------------------
# The law


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def logit(a: float) -> float:
    a = min(max(a, EPS), 1 - EPS)
    return math.log(a / (1 - a))


@dataclass
class Law:
    form: str
    alpha: float
    beta: float
    gamma: float
    fixed: dict[str, str] = field(default_factory=dict)  # parameter -> why it was fixed at its prior
    rmse: float = 0.0
    points: int = 0

    def z(self, n: float, d: float) -> float:
        return self.alpha + self.beta * math.log(n) + self.gamma * math.log(d)

    def predict(self, n: float, d: float) -> float:
        z = self.z(n, d)
        return sigmoid(z) if self.form == "sigmoid" else min(max(z, EPS), 1 - EPS)

    def to_dict(self) -> dict:
        formula = ("a = sigmoid(alpha + beta ln N + gamma ln D)" if self.form == "sigmoid"
                   else "a = clip(alpha + beta ln N + gamma ln D, (0, 1))")
        return {"form": self.form, "formula": formula, "alpha": self.alpha, "beta": self.beta, "gamma": self.gamma,
                "fixed": dict(self.fixed), "rmse": self.rmse, "points": self.points}


def _varies(xs: list[float]) -> bool:
    return max(xs) - min(xs) > 1e-9 * (1 + max(abs(x) for x in xs))


def _corr(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy)


def fit_law(points, form: str = "sigmoid", prior: dict | None = None) -> Law:
    """Least-squares fit of the law to ``points`` [(N parameters, D training tokens, acceptance)].

    The sigmoid form starts from the least-squares fit of the logits and is then refined by
    Gauss-Newton on the squared acceptance errors. A slope the points cannot identify is fixed at
    ``prior`` (default ``PRIORS[form]``), with the reason in ``Law.fixed``: beta when the sizes do not
    vary, gamma when the tokens do not, or when there are fewer than three points, or when ln N and
    ln D vary together (equal budgets: larger drafts see fewer tokens)."""
    import numpy as np

    if form not in FORMS:
        raise UsageError(f"the law's form must be one of {', '.join(FORMS)}, not {form!r}")
    pts = [(float(n), float(d), float(a)) for n, d, a in points]
    if not pts:
        raise SpecdecError("no points to fit the acceptance law to")
    for n, d, a in pts:
        if not (n > 0 and d > 0 and 0 <= a <= 1):
            raise SpecdecError(f"a point needs parameters > 0, training tokens > 0 and acceptance in [0, 1], not ({n}, {d}, {a})")
    prior = {**PRIORS[form], **(prior or {})}
    ln_n = [math.log(n) for n, _, _ in pts]
    ln_d = [math.log(d) for _, d, _ in pts]
    acc = [a for _, _, a in pts]
    fixed: dict[str, str] = {}
    if not _varies(ln_n):
        fixed["beta"] = "the points' sizes do not vary"
    if not _varies(ln_d):
        fixed["gamma"] = "the points' training tokens do not vary"
    if "beta" not in fixed and "gamma" not in fixed:
        if len(pts) < 3:
            fixed["gamma"] = f"{len(pts)} points cannot fit three parameters"
        elif abs(c := _corr(ln_n, ln_d)) > COLLINEAR:
            fixed["gamma"] = f"size and training tokens vary together (correlation {c:.3f}): their effects cannot be told apart"
    beta = prior["beta"] if "beta" in fixed else 0.0
    gamma = prior["gamma"] if "gamma" in fixed else 0.0
    free = ["alpha"] + [p for p in ("beta", "gamma") if p not in fixed]
    columns = {"alpha": [1.0] * len(pts), "beta": ln_n, "gamma": ln_d}
    X = np.array([columns[p] for p in free], dtype=np.float64).T
    offset = np.array([beta * x + gamma * y for x, y in zip(ln_n, ln_d)])
    y = np.array([logit(a) for a in acc] if form == "sigmoid" else acc, dtype=np.float64)
    theta = np.linalg.lstsq(X, y - offset, rcond=None)[0]
    target = np.array(acc)
    if form == "sigmoid":
        def loss(th):
            return float(((1 / (1 + np.exp(-(X @ th + offset))) - target) ** 2).sum())

        current = loss(theta)
        for _ in range(50):  # Gauss-Newton with step halving on the acceptance scale
            p = 1 / (1 + np.exp(-(X @ theta + offset)))
            J = X * (p * (1 - p))[:, None]
            step = np.linalg.lstsq(J, target - p, rcond=None)[0]
            scale = 1.0
            while scale > 1e-4:
                trial = theta + scale * step
                if (value := loss(trial)) < current:
                    break
                scale /= 2
            else:
                break
            gain = current - value
            theta, current = trial, value
            if gain < 1e-14:
                break
    params = {"alpha": 0.0, "beta": beta, "gamma": gamma} | {p: float(v) for p, v in zip(free, theta)}
    law = Law(form, params["alpha"], params["beta"], params["gamma"], fixed, points=len(pts))
    law.rmse = math.sqrt(sum((law.predict(n, d) - a) ** 2 for n, d, a in pts) / len(pts))
    return law


# ---------------------------------------------------------------------------------------------
# Training rate: seconds per training token against the draft's size


@dataclass
class TrainRate:
    s0: float  # seconds per token whatever the size (the target's teacher forward, data, the loop)
    s1: float  # seconds per token per parameter
    note: str = ""

    def seconds_per_token(self, n: float) -> float:
        return self.s0 + self.s1 * n

    def tokens(self, n: float, seconds: float) -> float:
        return seconds / self.seconds_per_token(n)

    def to_dict(self) -> dict:
        return {"seconds_per_token": "s0 + s1 * N", "s0": self.s0, "s1": self.s1, "note": self.note}


def fit_rate(points) -> TrainRate:
    """Seconds per training token = s0 + s1 * N by least squares over ``points`` [(N, tokens, seconds)]
    (both coefficients kept >= 0); one size only: proportional to N."""
    pts = [(float(n), float(d), float(s)) for n, d, s in points]
    if not pts or any(n <= 0 or d <= 0 or s <= 0 for n, d, s in pts):
        raise SpecdecError("the training rate needs points with parameters, training tokens and training seconds > 0")
    ns = [n for n, _, _ in pts]
    spt = [s / d for _, d, s in pts]

    def proportional(note):
        return TrainRate(0.0, sum(t * n for t, n in zip(spt, ns)) / sum(n * n for n in ns), note)

    if len(set(ns)) < 2:
        return proportional("one size measured: time per token taken as proportional to parameters")
    mn, mt = sum(ns) / len(ns), sum(spt) / len(spt)
    s1 = sum((n - mn) * (t - mt) for n, t in zip(ns, spt)) / sum((n - mn) ** 2 for n in ns)
    s0 = mt - s1 * mn
    if s1 <= 0:
        return TrainRate(mt, 0.0, "time per token did not grow with size: taken as constant")
    if s0 < 0:
        return proportional("time per token fitted as proportional to parameters (a fixed part came out negative)")
    return TrainRate(s0, s1, "least squares over the points")


# ---------------------------------------------------------------------------------------------
# Sizes


def parse_sizes(text: str) -> list[str]:
    """``--sizes``: arch strings separated by ';' (or whitespace); within one, a key that repeats
    starts the next size, so ``layers=1,hidden=32,heads=4,layers=2,hidden=64,heads=4`` is two."""
    from specdec.train.trainers.draft import parse_arch

    sizes: list[str] = []
    for chunk in text.replace(";", " ").split():
        current: list[str] = []
        keys: set[str] = set()
        for item in filter(None, (p.strip() for p in chunk.split(","))):
            key = item.partition("=")[0].strip()
            if key in keys:
                sizes.append(",".join(current))
                current, keys = [], set()
            current.append(item)
            keys.add(key)
        if current:
            sizes.append(",".join(current))
    if not sizes:
        raise UsageError("--sizes names no size: give arch strings such as 'layers=1,hidden=64,heads=2;layers=2,hidden=128,heads=4'")
    for s in sizes:
        parse_arch(s)  # a bad item is a usage error now, before anything trains
    return sizes


def arch_string(arch: dict) -> str:
    return f"layers={arch['layers']},hidden={arch['hidden']},heads={arch['heads']}"


def arch_of(spec: str) -> dict:
    """``layers/hidden/heads`` of an arch string, train-draft's defaults for those it leaves out."""
    from specdec.train.trainers.draft import parse_arch

    kw = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4} | parse_arch(spec)
    return {"layers": kw["num_hidden_layers"], "hidden": kw["hidden_size"], "heads": kw["num_attention_heads"]}


def ladder(archs: list[dict]) -> list[dict]:
    """Candidate sizes around and between ``archs`` ({layers, hidden, heads}): each of them, the
    geometric middle of each neighbouring pair, half the smallest's width (or depth) and twice the
    largest's width; head width kept from the nearest given size."""
    if not archs:
        return []
    given = sorted(archs, key=lambda a: (a["layers"] * a["hidden"] ** 2, a["hidden"]))

    def make(layers, hidden, like):
        hd = max(1, like["hidden"] // like["heads"])
        heads = max(1, round(hidden / hd))
        return {"layers": max(1, int(round(layers))), "hidden": heads * hd, "heads": heads}

    out = list(given)
    small, large = given[0], given[-1]
    if small["heads"] > 1:
        out.append(make(small["layers"], small["hidden"] / 2, small))
    elif small["layers"] > 1:
        out.append(make(small["layers"] / 2, small["hidden"], small))
    out.append(make(large["layers"], large["hidden"] * 2, large))
    for a, b in zip(given, given[1:]):
        out.append(make(math.sqrt(a["layers"] * b["layers"]), math.sqrt(a["hidden"] * b["hidden"]), a))
    seen, result = set(), []
    for a in out:
        key = (a["layers"], a["hidden"], a["heads"])
        if key not in seen:
            seen.add(key)
            result.append(a)
    return sorted(result, key=lambda a: (a["layers"] * a["hidden"] ** 2, a["hidden"]))


# ---------------------------------------------------------------------------------------------
# Recommendation


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round of k drafts yields, the bonus token counted: (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def speedup(a: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Expected tokens per round over its cost, both in units of the target's one-token forward."""
    return expected_tokens(a, k) / (k * draft_cost + verify_cost)


@dataclass
class Candidate:
    name: str
    parameters: int
    draft_cost: float  # one-token forward, in units of the target's one-token forward
    arch: str | None = None
    trained: bool = False
    measured_acceptance: float | None = None
    train_tokens: float | None = None  # at the training budget (filled by recommend)
    acceptance: float | None = None  # predicted at those tokens (filled by recommend)


def recommend(candidates: list[Candidate], law: Law, verify_costs: dict[int, float], tokens, k_max: int = K_MAX) -> dict:
    """Every candidate's expected speedup for k = 1..k_max, with acceptance ``law.predict(N,
    tokens(N))`` (``tokens``: training tokens at the budget for N parameters) and ``verify_costs[w]``
    the target's forward of w tokens per row in units of its one-token forward. Returns
    {"rows": [...], "best": {...}} (the best (size, k) over all)."""
    rows, best = [], None
    for c in candidates:
        c.train_tokens = float(tokens(c.parameters))
        c.acceptance = law.predict(c.parameters, c.train_tokens)
        by_k = {k: speedup(c.acceptance, k, c.draft_cost, verify_costs[k + 1]) for k in range(1, k_max + 1)}
        k_best = max(by_k, key=lambda k: by_k[k])
        row = {"name": c.name, "arch": c.arch, "parameters": c.parameters, "trained": c.trained,
               "measured_acceptance": c.measured_acceptance, "train_tokens": c.train_tokens, "acceptance": c.acceptance,
               "draft_cost": c.draft_cost, "speedup_by_k": {str(k): s for k, s in by_k.items()}, "best_k": k_best,
               "best_speedup": by_k[k_best], "expected_tokens": expected_tokens(c.acceptance, k_best)}
        rows.append(row)
        if best is None or row["best_speedup"] > best["speedup"]:
            best = {"name": c.name, "arch": c.arch, "parameters": c.parameters, "trained": c.trained, "k": k_best,
                    "speedup": by_k[k_best], "acceptance": c.acceptance, "expected_tokens": row["expected_tokens"],
                    "train_tokens": c.train_tokens}
    if best is not None:
        best["pays"] = best["speedup"] > 1.0
    return {"rows": rows, "best": best}


# ---------------------------------------------------------------------------------------------
# Points: existing artifacts or quick drafts trained here


@dataclass
class Point:
    name: str
    path: str
    parameters: int
    train_tokens: int
    train_seconds: float
    acceptance: float
    arch: dict | None = None  # {layers, hidden, heads} from its config.json
    fingerprint: dict | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "parameters": self.parameters, "train_tokens": self.train_tokens,
                "train_seconds": self.train_seconds, "acceptance": self.acceptance,
                "arch": arch_string(self.arch) if self.arch else None}


def check_artifact_dirs(dirs: list[str | Path]) -> None:
    """Usage errors (exit 2) for ``--artifacts`` folders that are not there or not draft artifacts."""
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise UsageError(f"--artifacts {d}: no such folder")
        for name in ("config.json", "metrics.json"):
            if not (p / name).is_file():
                raise UsageError(f"--artifacts {d}: no {name} (a draft artifact from specdec train-draft is needed)")


def read_point(path: str | Path) -> Point:
    """A draft artifact's point: parameters, training tokens and seconds, and its held-out per-token
    agreement with the target's greedy choice (metrics.json's ``top1_agreement``)."""
    import json

    from specdec.models.artifacts import read_config

    path = Path(path)
    check_artifact_dirs([path])
    cfg = read_config(path)
    try:
        metrics = json.loads((path / "metrics.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"{path / 'metrics.json'} is not valid JSON: {exc}") from None
    if metrics.get("kind", "draft") != "draft" or cfg.get("specdec_kind", "draft") != "draft":
        raise UsageError(f"--artifacts {path}: a {metrics.get('kind') or cfg.get('specdec_kind')} artifact, not a draft model")
    need = ("parameters", "train_tokens", "train_wall_s", "top1_agreement")
    missing = [k for k in need if not isinstance(metrics.get(k), (int, float))]
    if missing:
        raise SpecdecError(f"{path / 'metrics.json'} lacks {', '.join(missing)} (written by an older specdec train-draft?)")
    if metrics["train_tokens"] <= 0 or metrics["train_wall_s"] <= 0:
        raise SpecdecError(f"{path}: no training recorded (train_tokens {metrics['train_tokens']}, train_wall_s {metrics['train_wall_s']})")
    tc = cfg.get("text_config") or cfg
    arch = None
    if all(isinstance(tc.get(k), int) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")):
        arch = {"layers": tc["num_hidden_layers"], "hidden": tc["hidden_size"], "heads": tc["num_attention_heads"]}
    return Point(path.name, str(path), int(metrics["parameters"]), int(metrics["train_tokens"]), float(metrics["train_wall_s"]),
                 float(metrics["top1_agreement"]), arch, cfg.get("specdec_target"))


def train_points(target: str, data: list, sizes: list[str], cfg, work_dir: Path, placement=None, knobs: dict | None = None,
                 say=None) -> list[Point]:
    """One quick draft per size, each through ``train_draft`` with the same config (budget, steps,
    seed: the same held-out blocks measure every one). The teacher runs on the fly, so the
    training rate counts its forwards per token."""
    from specdec.train.trainers.draft import train_draft

    knobs = dict(knobs or {}) | {"cache_teacher": False}
    points = []
    for i, size in enumerate(sizes):
        out = Path(work_dir) / f"draft-{i}"
        if say:
            say(f"training quick draft {i + 1}/{len(sizes)}: {size}")
        train_draft(target, data, out, cfg, arch=size, placement=placement, **knobs)
        p = read_point(out)
        p.name = size
        p.arch = arch_of(size)
        points.append(p)
    return points


# ---------------------------------------------------------------------------------------------
# Costs


def timing_prefix(target, length: int = 128) -> list[int]:
    from specdec.models.arch import text_config

    tc = text_config(target.config)
    room = int(getattr(tc, "max_position_embeddings", 2048) or 2048) - K_MAX - 2
    vocab = int(tc.vocab_size)
    return [(7 + 7919 * i) % vocab for i in range(max(1, min(length, room)))]


def time_model(model, prefix: list[int], t: int, batch_size: int, repeats: int) -> float:
    from specdec.decode.measure import time_forward

    vocab = model.get_input_embeddings().weight.shape[0]  # a draft over a reduced vocabulary takes its own ids
    return time_forward(model, [i % vocab for i in prefix], t, repeats, batch_size=batch_size, greedy=True)


def random_draft(target, arch: str, vocab: int | None = None):
    """A randomly initialised draft of this size (train-draft's architecture), placed as the target: to time it.
    ``vocab``: the rows of its embedding and output layer where the drafts compared have a reduced vocabulary."""
    import torch

    from specdec.models.loading import input_device
    from specdec.train.trainers.draft import new_draft

    torch.manual_seed(0)
    model = new_draft(target.config, arch)
    if vocab is not None and vocab != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab, mean_resizing=False)
    return model.to(device=input_device(target), dtype=target.dtype).eval().requires_grad_(False)


def _vocab_of(path) -> int | None:
    """A draft artifact's vocabulary size (its config's), None where the config does not say."""
    from specdec.models.artifacts import read_config

    cfg = read_config(path)
    size = (cfg.get("text_config") or cfg).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def artifact_model(target, path: str | Path, trust_remote_code: bool = False):
    """A draft artifact's architecture, randomly initialised (its weights do not change its cost), placed as the target."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.loading import input_device

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model.to(device=input_device(target), dtype=target.dtype).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass
class PlanConfig:
    target: str
    data: list = field(default_factory=list)
    sizes: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)
    batch_size: int = 1
    train_budget_minutes: float | None = None
    form: str = "sigmoid"
    repeats: int = 10
    train_config: object = None  # TrainConfig of the quick drafts
    knobs: dict = field(default_factory=dict)
    drafts_dir: Path | None = None
    placement: object = None
    command: str | None = None


def check_plan(cfg: PlanConfig) -> None:
    """Usage errors before anything loads."""
    if not cfg.data and not cfg.artifacts:
        raise UsageError("give --data (quick drafts are trained on it) or --artifacts DIR,DIR,... (draft artifacts' metrics are read)")
    if cfg.data and cfg.artifacts:
        raise UsageError("give --data or --artifacts, not both")
    if cfg.sizes and cfg.artifacts:
        raise UsageError("--sizes goes with --data (the quick drafts' sizes); --artifacts brings its own")
    if cfg.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, not {cfg.batch_size}")
    if cfg.train_budget_minutes is not None and not cfg.train_budget_minutes > 0:
        raise UsageError(f"--train-budget-minutes must be > 0, not {cfg.train_budget_minutes}")
    if cfg.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, not {cfg.repeats}")
    if cfg.form not in FORMS:
        raise UsageError(f"--law must be one of {', '.join(FORMS)}, not {cfg.form!r}")
    for f in cfg.data:
        if not Path(f).is_file():
            raise UsageError(f"--data {f}: no such file")
    check_artifact_dirs(cfg.artifacts)
    if len(set(Path(a).resolve() for a in cfg.artifacts)) < len(cfg.artifacts):
        raise UsageError("--artifacts names a folder twice")


def run_plan(cfg: PlanConfig, say=None) -> dict:
    """Points, fit, costs and the recommendation, as the JSON report."""
    import gc
    import tempfile

    from specdec.bench.report import provenance, shown_path
    from specdec.models.artifacts import check_fingerprint, tokenizer_fingerprint
    from specdec.models.loading import Placement, input_device, load_target

    check_plan(cfg)
    placement = cfg.placement or Placement()
    started = time.perf_counter()
    if cfg.artifacts:
        points = [read_point(a) for a in cfg.artifacts]
        source = "artifacts"
    else:
        sizes = list(cfg.sizes or DEFAULT_SIZES)
        if cfg.drafts_dir is not None:
            points = train_points(cfg.target, cfg.data, sizes, cfg.train_config, Path(cfg.drafts_dir), placement, cfg.knobs, say)
        else:
            with tempfile.TemporaryDirectory(prefix="specdec-plan-") as tmp:
                points = train_points(cfg.target, cfg.data, sizes, cfg.train_config, Path(tmp), placement, cfg.knobs, say)
        source = "trained"
    gc.collect()

    target, tokenizer, _ = load_target(cfg.target, placement, rows=cfg.batch_size)
    fp = tokenizer_fingerprint(tokenizer)
    for p in points:
        if p.fingerprint:
            check_fingerprint(p.fingerprint, fp, f"--artifacts {p.path}")

    notes: list[str] = []
    law = fit_law([(p.parameters, p.train_tokens, p.acceptance) for p in points], cfg.form)
    for name, why in law.fixed.items():
        notes.append(f"{name} fixed at the prior {getattr(law, name)} ({why})")
    rate = fit_rate([(p.parameters, p.train_tokens, p.train_seconds) for p in points])
    if cfg.train_budget_minutes is not None:
        budget_min, budget_from = float(cfg.train_budget_minutes), "--train-budget-minutes"
    else:
        secs = sorted(p.train_seconds for p in points)
        budget_min, budget_from = secs[len(secs) // 2] / 60, "the points' median training time (give --train-budget-minutes to plan for another)"
        notes.append(f"training budget: {budget_from}")
    budget_s = budget_min * 60

    # costs, in units of the target's one-token forward at this batch size
    prefix = timing_prefix(target)
    if say:
        say(f"timing the target's forwards of 1..{K_MAX + 1} tokens at batch size {cfg.batch_size}")
    target_s = {w: time_model(target, prefix, w, cfg.batch_size, cfg.repeats) for w in range(1, K_MAX + 2)}
    t1 = target_s[1]
    verify = {w: s / t1 for w, s in target_s.items()}

    candidates: list[Candidate] = []
    draft_s: dict[str, float] = {}
    trust = bool(getattr(placement, "trust_remote_code", False))
    for p in points:
        model = (random_draft(target, arch_string(p.arch)) if source == "trained"
                 else artifact_model(target, p.path, trust))
        draft_s[p.name] = time_model(model, prefix, 1, cfg.batch_size, cfg.repeats)
        del model
        candidates.append(Candidate(p.name, p.parameters, draft_s[p.name] / t1, arch_string(p.arch) if p.arch else None, True, p.acceptance))
    # sizes no point was trained at are timed at the points' vocabulary (a reduced one costs far fewer output rows)
    vocabs = {_vocab_of(p.path) for p in points} if source == "artifacts" else {None}
    vocab = vocabs.pop() if len(vocabs) == 1 else None
    trained_keys = {(p.arch["layers"], p.arch["hidden"], p.arch["heads"]) for p in points if p.arch}
    extra = [a for a in ladder([p.arch for p in points if p.arch]) if (a["layers"], a["hidden"], a["heads"]) not in trained_keys]
    if say and extra:
        say(f"timing {len(extra)} more draft sizes (random weights)")
    for a in extra:
        spec = arch_string(a)
        try:
            model = random_draft(target, spec, vocab)
        except SpecdecError as exc:  # this architecture cannot take that size
            notes.append(f"size {spec} left out: {exc}")
            continue
        n = sum(t.numel() for t in model.parameters())
        draft_s[spec] = time_model(model, prefix, 1, cfg.batch_size, cfg.repeats)
        del model
        candidates.append(Candidate(spec, n, draft_s[spec] / t1, spec, False))
    candidates.sort(key=lambda c: c.parameters)

    rec = recommend(candidates, law, verify, lambda n: rate.tokens(n, budget_s))
    notes.append("acceptance is per row (teacher-forced greedy agreement on held-out text); the batch size enters through the measured costs")
    if not rec["best"]["pays"]:
        notes.append("no draft size beats plain decoding at this batch size on this device")
    device = input_device(target)
    return {
        "kind": "plan",
        "provenance": provenance(cfg.command, device),
        "target": shown_path(cfg.target) if Path(cfg.target).exists() else cfg.target,
        "device": str(device),
        "batch_size": cfg.batch_size,
        "points_from": source,
        "points": [p.to_dict() for p in points],
        "law": law.to_dict(),
        "training_rate": rate.to_dict(),
        "train_budget_minutes": budget_min,
        "train_budget_from": budget_from,
        "costs": {"unit": "the target's one-token forward at this batch size", "target_one_token_s": t1,
                  "target_forward_s": {str(w): s for w, s in target_s.items()}, "verify": {str(w): v for w, v in verify.items()},
                  "draft_one_token_s": draft_s},
        "formula": "S = (1 - a^(k+1)) / (1 - a) / (k * c_draft + c_verify(k + 1))",
        "candidates": rec["rows"],
        "best": rec["best"],
        "notes": notes,
        "wall_s": round(time.perf_counter() - started, 3),
    }


# ---------------------------------------------------------------------------------------------
# Rendering


def table(report: dict):
    from rich.table import Table

    best = report["best"]
    t = Table(title=f"specdec plan: batch size {report['batch_size']}, training budget {report['train_budget_minutes']:.3g} min "
                    f"({report['device']})")
    for col in ("draft size", "params", "trained", "train tokens", "a measured", "a predicted", "c_draft",
                *[f"S k={k}" for k in range(1, K_MAX + 1)], "best k", "best S"):
        t.add_column(col, justify="left" if col == "draft size" else "right", overflow="fold", no_wrap=col == "draft size")
    for r in report["candidates"]:
        mark = "*" if r["name"] == best["name"] else ""
        t.add_row(
            r["name"] + mark, f"{r['parameters']:,}", "yes" if r["trained"] else "-", f"{r['train_tokens']:.3g}",
            "-" if r["measured_acceptance"] is None else f"{r['measured_acceptance']:.3f}", f"{r['acceptance']:.3f}",
            f"{r['draft_cost']:.3f}", *[f"{r['speedup_by_k'][str(k)]:.2f}" for k in range(1, K_MAX + 1)],
            str(r["best_k"]), f"{r['best_speedup']:.2f}",
        )
    law = report["law"]
    fixed = f"; fixed: {', '.join(law['fixed'])}" if law["fixed"] else ""
    t.caption = (f"{law['formula']}: alpha={law['alpha']:.3g} beta={law['beta']:.3g} gamma={law['gamma']:.3g} "
                 f"(rmse {law['rmse']:.3g} over {law['points']} points{fixed}); S in units of the target's one-token forward")
    return t


def summary_line(report: dict) -> str:
    b = report["best"]
    what = f"{b['name']} ({b['parameters']:,} parameters{', trained' if b['trained'] else ''})"
    line = (f"recommendation: draft {what}, draft length k={b['k']}: expected speedup {b['speedup']:.2f}x "
            f"(acceptance {b['acceptance']:.3f}, {b['expected_tokens']:.2f} tokens per round)")
    return line if b["pays"] else line + "; no draft beats plain decoding here"


def plot(report: dict, path: str | Path) -> Path:
    """Acceptance against size (the points, the fit at the training budget, the candidates) and S against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law = Law(report["law"]["form"], report["law"]["alpha"], report["law"]["beta"], report["law"]["gamma"])
    rate = TrainRate(report["training_rate"]["s0"], report["training_rate"]["s1"])
    budget_s = report["train_budget_minutes"] * 60
    rows = report["candidates"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ns = [r["parameters"] for r in rows]
    lo, hi = min(ns) / 1.5, max(ns) * 1.5
    grid = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    ax1.plot(grid, [law.predict(n, rate.tokens(n, budget_s)) for n in grid], label=f"fit at {report['train_budget_minutes']:.3g} min")
    pts = report["points"]
    ax1.scatter([p["parameters"] for p in pts], [p["acceptance"] for p in pts], color="black", zorder=3, label="measured")
    ax1.scatter(ns, [r["acceptance"] for r in rows], marker="x", color="tab:orange", zorder=3, label="candidates")
    ax1.set_xscale("log")
    ax1.set_xlabel("draft parameters")
    ax1.set_ylabel("acceptance (per token)")
    ax1.legend()
    ks = list(range(1, K_MAX + 1))
    for r in rows:
        style = "-" if r["name"] == report["best"]["name"] else ":"
        ax2.plot(ks, [r["speedup_by_k"][str(k)] for k in ks], style, marker="o", markersize=3, label=r["name"])
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_xlabel("draft length k")
    ax2.set_ylabel("expected speedup")
    ax2.legend(fontsize=7)
    fig.suptitle(f"specdec plan: batch size {report['batch_size']}")
    fig.tight_layout()
    Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
