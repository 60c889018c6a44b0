"""train-acceptance: the SpecDec++ acceptance heads on a draft's last hidden state.

A head predicts P(draft token accepted | earlier drafts accepted) from what the draft knows when
it proposes the token: its last hidden state at the position that produced q, and three statistics
of q there (q(x) of the proposed token, max q, entropy). The stop decision therefore needs no draft
forward of the token itself: a round that stops costs exactly the forwards of a fixed-length round.

One artifact holds two heads, one per decode mode:
- sampling (T > 0; SpecDec++, Huang et al. 2024): label min(1, p(x)/q(x)) on the draft's own sampled
  token x (15% of positions use a token of the target instead), soft-label BCE with the reject class
  up-weighted (x6 in the paper's code);
- greedy (T = 0): the draft proposes argmax q, which is accepted iff it is argmax p. Label
  1[argmax q == argmax p] at each position of the target's own greedy continuations of corpus
  prefixes, the text a greedy decode verifies drafts against.
Any reject weight w is undone at save time (bias + log w), so both heads output calibrated
probabilities and a stop threshold means 1 - P(all drafts accepted). Draft and target are frozen:
features and labels are computed once and the loop trains only the heads. The greedy head's default
stop policy is chosen by replaying held-out greedy decoding under the engine's measured round costs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.models.acceptance import FEATURES, HEAD_MODES, N_STATS, AcceptanceHead
from specdec.models.artifacts import SpecdecError, UsageError, check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.train.trainers.acceptance_labels import draw_acceptance, label_blocks, label_continuations, target_continuations
from specdec.train.trainers.acceptance_policy import POLICY_PROMPTS, choose_policy, measure_round_costs, onpolicy_greedy
from specdec.train.loop import TrainConfig, make_accelerator, run_training, save_config
from specdec.train.settings import AcceptanceSettings


def train_acceptance(target_dir: str | Path, draft_dir: str | Path, data_files: list[str | Path], out_dir: str | Path,
                     cfg: TrainConfig, settings: AcceptanceSettings | None = None, *, resume: bool = False, placement=None,
                     **changes) -> dict:
    """Train the sampling head and the greedy head of one acceptance artifact; choose each mode's default
    stop policy by simulation (``choose_policy``) under the engine's measured round costs: the greedy
    one on the target's held-out greedy continuations, the sampling one on its continuations sampled at
    ``temperature`` (the artifact's temperature: its head's labels and its policy are for that one).

    Greedy head data: the target's own greedy continuations of ``greedy_prefix``-token block prefixes,
    the text a greedy decode verifies drafts against. Corpus text is left out of its training: the
    features cannot tell the two texts apart, and the target agrees with its draft more often on its
    own repetitive output, so corpus labels would teach the wrong rate (the head's calibration on
    held-out corpus text is still reported). Budget: ~20% labels the corpus, ~20% generates
    and labels continuations, ~15% held-out data, a few seconds measure round costs, the rest trains
    the two heads (half each). Round costs: ``cost_reps`` interleaved timings (default 3; 1 under a
    budget below 90 s) of 4 held-out prompts decoding ``cost_new_tokens`` tokens each.

    ``policy_prompts``: a prompts JSONL like the ones the artifact will decode (decode's input format).
    The greedy policy's real-round re-ranking (``onpolicy_greedy``) runs on its first
    ``POLICY_PROMPTS`` prompts instead of held-out block prefixes: prefixes cut from the training text
    are text the target has seen, where it agrees with its draft more than after a user's prompt.

    The steps: the settings checked (``AcceptanceSettings.check``), the frozen target and draft loaded
    (``_load``), the training and held-out features and labels computed once (``_labels``), the two heads
    trained on them in half the budget left each (``_Budget.heads_config``, ``_train_heads``, loss
    ``weighted_bce``), and the policies chosen, the heads evaluated and the artifact written (``_finish``)."""
    from specdec.train.data import load_blocks

    s = dataclasses.replace(settings or AcceptanceSettings(), **changes)
    s.check()
    models = _load(target_dir, draft_dir, placement, cfg)
    user_prompts = read_policy_prompts(s.policy_prompts, models.tokenizer) if s.policy_prompts else None
    train_blocks, held_blocks = load_blocks(data_files, models.tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    # the budget starts after loading: reading and tokenising the corpus is a fixed cost (10+ s for the
    # default family's) that would otherwise eat a small budget's labelling share whole
    budget = _Budget(time.perf_counter(), cfg.budget_minutes * 60)
    labels = _labels(s, models, train_blocks, held_blocks, cfg, budget)
    cfg = budget.heads_config(cfg)
    out_dir = Path(out_dir)
    trained, results = _train_heads(s, models.draft.config.hidden_size, labels, cfg, out_dir, resume)
    if not results["sampling"].is_main:
        return {}
    return _finish(s, models, labels, trained, results, user_prompts, cfg, budget, target_dir, draft_dir, data_files, out_dir)


@dataclass
class _Models:
    """The frozen target and draft the heads learn about, the target's tokenizer and its fingerprint, and the
    draft's config."""

    target: object
    tokenizer: object
    fp: dict
    draft: object
    draft_config: dict


def _load(target_dir, draft_dir, placement, cfg: TrainConfig) -> _Models:
    """The target, and the draft on the target's input device in its dtype; a draft made for another target
    (its fingerprint) or another vocabulary is refused."""
    from specdec.models.loading import Placement, input_device, load_draft
    from specdec.train.data import load_teacher

    target, tokenizer = load_teacher(target_dir, placement, make_accelerator(cfg))
    fp = tokenizer_fingerprint(tokenizer)
    dcfg = read_config(draft_dir)
    if "specdec_target" in dcfg:
        check_fingerprint(dcfg["specdec_target"], fp, f"draft {draft_dir}")
    draft = load_draft(draft_dir, placement or Placement(), device=input_device(target), dtype=target.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecdecError(f"draft {draft_dir} has vocabulary size {draft.config.vocab_size}, the target {target.config.vocab_size}")
    return _Models(target, tokenizer, fp, draft, dcfg)


@dataclass
class _Budget:
    """The wall-clock budget (seconds; 0: none) from ``start``: each step's share ends at a fraction of it."""

    start: float
    seconds: float

    def until(self, frac: float) -> float | None:
        return self.start + frac * self.seconds if self.seconds else None

    def heads_config(self, cfg: TrainConfig) -> TrainConfig:
        """The config each head trains under: the two share what is left, half each, after a reserve for
        measuring both modes' round costs."""
        if not self.seconds:
            return cfg
        left = max(self.seconds - (time.perf_counter() - self.start) - 0.15 * self.seconds, 0.2 * self.seconds)
        return dataclasses.replace(cfg, budget_minutes=left / 2 / 60)


@dataclass
class _Labels:
    """The heads' data, computed once (draft and target are frozen). ``train``: per mode, features [N, F] and
    labels [N]. ``held``: the same on held-out corpus blocks. ``held_greedy`` / ``held_sampled``: features
    [N, L, F] and labels [N, L] along the target's held-out continuations, greedy and sampled at the
    settings' temperature; ``held_continuations``: those greedy continuations' tokens, whose first
    ``prefix`` are prompts of the round-cost timings and the on-policy re-ranking."""

    train: dict
    held: dict
    held_greedy: tuple
    held_sampled: tuple
    held_continuations: object
    prefix: int
    new: int
    train_sequences: int
    sampled_sequences: int


def _labels(s: AcceptanceSettings, models: _Models, train_blocks, held_blocks, cfg: TrainConfig, budget: _Budget) -> _Labels:
    """The sampling head's labels on the corpus, the greedy head's on the target's greedy continuations of
    block prefixes, and the held-out sets, each step within its share of the budget."""
    draft, target = models.draft, models.target
    prefix = max(1, min(s.greedy_prefix, cfg.seq_len // 2))
    new = max(2, min(s.greedy_new_tokens, int(getattr(target.config, "max_position_embeddings", 1 << 20)) - prefix))
    data = label_blocks(draft, target, train_blocks, s.temperature, s.target_token_frac, cfg.seed, deadline=budget.until(0.2),
                        modes=("sampling",))
    cont = target_continuations(target, train_blocks, prefix, new, limit=s.greedy_sequences, deadline=budget.until(0.4))
    cont_h, cont_y = label_continuations(draft, target, cont, prefix)
    data["greedy"] = (cont_h.flatten(0, 1), cont_y.flatten())
    if len(held_blocks) == 0:
        raise UsageError("train-acceptance needs held-out blocks for calibration and the stop policy (heldout > 0)")
    held = label_blocks(draft, target, held_blocks, s.temperature, s.target_token_frac, cfg.seed + 1, deadline=budget.until(0.45))
    n_held = max(16, s.greedy_sequences // 8)
    held_cont = target_continuations(target, held_blocks, prefix, new, limit=n_held, deadline=budget.until(0.5))
    held_greedy = label_continuations(draft, target, held_cont, prefix)
    held_samp = target_continuations(target, held_blocks, prefix, new, s.temperature, cfg.seed + 2, limit=n_held,
                                     deadline=budget.until(0.55))
    held_sampled = label_continuations(draft, target, held_samp, prefix, s.temperature, cfg.seed + 3)
    return _Labels(data, held, held_greedy, held_sampled, held_cont, prefix, new, len(cont), len(held_samp))


def _train_heads(s: AcceptanceSettings, hidden: int, labels: _Labels, cfg: TrainConfig, out_dir: Path,
                 resume: bool) -> tuple[dict, dict]:
    """Each mode's head trained through the shared loop on its features (loss ``weighted_bce`` at its reject
    weight); returns the calibrated heads (main process) and the loops' results."""
    import torch

    torch.manual_seed(cfg.seed)
    heads = {m: AcceptanceHead(hidden + N_STATS, s.num_layers) for m in HEAD_MODES}
    weights = {"sampling": s.reject_weight, "greedy": s.greedy_reject_weight}
    trained, results = {}, {}
    for mode in HEAD_MODES:
        h_train, y_train = labels.train[mode]
        w = weights[mode]

        def loss_fn(model, batch, w=w):
            return weighted_bce(model(batch["h"]).float(), batch["y"], w)

        sub = out_dir if mode == "sampling" else out_dir / "greedy-head"  # each head's checkpoints
        result = run_training(cfg, heads[mode], loss_fn, TensorDict(h=h_train, y=y_train), sub, resume=resume,
                              accelerator=make_accelerator(cfg), label=f"{mode} head")
        results[mode] = result
        if result.is_main:
            head = result.model.float()
            with torch.no_grad():
                # weighted BCE's optimum is odds(s) = odds(y) / w; the saved head adds log w back (calibrated)
                head.out.bias += math.log(w)
            trained[mode] = head
    return trained, results


def _finish(s: AcceptanceSettings, models: _Models, labels: _Labels, trained: dict, results: dict, user_prompts, cfg: TrainConfig,
            budget: _Budget, target_dir, draft_dir, data_files, out_dir: Path) -> dict:
    """Each mode's round costs measured with its trained head, its default stop policy chosen (the greedy one
    re-ranked on real rounds), the heads' held-out calibration, and the artifact written with its metrics."""
    import torch
    from safetensors.torch import save_file

    target, tokenizer, draft, prefix = models.target, models.tokenizer, models.draft, labels.prefix
    temperature, reject_weight = s.temperature, s.reject_weight
    held_cont = labels.held_continuations
    n_prompts = min(4, len(held_cont))
    cost_reps = s.cost_reps
    if cost_reps is None:
        cost_reps = 3 if not budget.seconds or budget.seconds >= 90 else 1
    cost_prompts = [row[:prefix].tolist() for row in held_cont[:n_prompts]]
    costs = {mode: measure_round_costs(target, tokenizer, draft, trained[mode], cost_prompts, new_tokens=s.cost_new_tokens,
                                       reps=cost_reps, temperature=0.0 if mode == "greedy" else temperature)
             for mode in HEAD_MODES}

    held, (held_h, held_y), (held_sh, held_sy) = labels.held, labels.held_greedy, labels.held_sampled
    with torch.no_grad():
        h_s, y_s = held["sampling"]
        pred_s = torch.sigmoid(trained["sampling"](h_s))
        raw_s = torch.sigmoid(trained["sampling"](h_s) - math.log(reject_weight))
        pred_g = torch.sigmoid(trained["greedy"](held_h))  # [N, L] along held-out greedy text
        pred_gc = torch.sigmoid(trained["greedy"](held["greedy"][0]))
        pred_ss = torch.sigmoid(trained["sampling"](held_sh))  # [N, L] along held-out sampled text
    sampling = calibration(pred_s, y_s)
    sampling["uncorrected_brier"] = float(((raw_s - y_s) ** 2).mean())
    greedy = calibration(pred_g.flatten(), held_y.flatten())
    greedy["corpus_text"] = {k: v for k, v in calibration(pred_gc, held["greedy"][1]).items() if k != "reliability_bins"}
    policies, sims = {}, {}
    policies["greedy"], sims["greedy"] = choose_policy(pred_g, held_y, costs["greedy"])
    # greedy rounds are deterministic: the simulation's best few are re-ranked on real rounds
    onpolicy_prompts = user_prompts or [row[:prefix].tolist() for row in held_cont[n_prompts : n_prompts + 8]] or cost_prompts
    policies["greedy"], sims["greedy"]["onpolicy"] = onpolicy_greedy(target, tokenizer, draft, trained["greedy"], onpolicy_prompts,
                                                                      sims["greedy"], costs["greedy"])
    sims["greedy"]["onpolicy"]["prompts_from"] = str(s.policy_prompts) if user_prompts else "held-out block prefixes"
    sims["greedy"]["chosen"], sims["greedy"]["chosen_kind"] = sims["greedy"]["onpolicy"]["chosen"], sims["greedy"]["onpolicy"]["chosen_kind"]
    # sampled rounds replayed as coin flips with each draft's chance min(1, p/q), 8 draws per continuation
    policies["sampling"], sims["sampling"] = choose_policy(*draw_acceptance(pred_ss, held_sy, 8, cfg.seed + 4), costs["sampling"])
    sims["sampling"]["temperature"] = temperature
    metrics = dict(
        kind="acceptance", heads=list(HEAD_MODES), sampling=sampling, greedy=greedy,
        steps={m: r.steps for m, r in results.items()}, stopped={m: r.stopped for m, r in results.items()},
        train_wall_s={m: round(r.wall_s, 3) for m, r in results.items()},
        loss_curve={m: r.losses for m, r in results.items()},
        train_positions={m: len(labels.train[m][1]) for m in HEAD_MODES},
        heldout_positions={"sampling": len(y_s), "greedy": int(held_y.numel())},
        greedy_text={"prefix_tokens": prefix, "new_tokens": labels.new, "train_sequences": labels.train_sequences,
                     "heldout_sequences": len(held_cont)},
        sampled_text={"temperature": temperature, "heldout_sequences": labels.sampled_sequences},
        round_costs=costs, policy_simulation=sims,
        note="sampling: Brier against the soft labels min(1, p/q) on held-out draft samples (T=%g); training up-weights the "
             "reject class by w and the saved head's output bias includes + log w, which undoes that shift (uncorrected_brier "
             "is the head without it). greedy: labels 1[argmax q == argmax p] on the target's greedy continuations of held-out "
             "block prefixes (corpus_text: on held-out corpus text). policy_simulation: per mode, decoding replayed on the "
             "target's held-out continuations (greedy; sampled at T=%g, each draft kept with its chance min(1, p/q), 8 draws) "
             "under that mode's round_costs; the chosen policies are the artifact's defaults" % (temperature, temperature),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {f"{m}.{k}": v.detach().float().contiguous() for m, head in trained.items() for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"))
    hidden = draft.config.hidden_size
    write_json(out_dir / "config.json", {
        "kind": "acceptance", "target": models.fp,
        "draft": {"path": str(Path(draft_dir).resolve()), "fingerprint": models.draft_config.get("specdec_target", models.fp),
                  "hidden_size": hidden},
        "hidden_size": hidden, "features": FEATURES, "input_size": hidden + N_STATS, "num_layers": s.num_layers,
        "heads": list(HEAD_MODES), "reject_weight": {"sampling": reject_weight, "greedy": s.greedy_reject_weight},
        "target_token_frac": s.target_token_frac, "temperature": temperature,
        "policy": {mode: dataclasses.asdict(policies[mode]) for mode in HEAD_MODES},
    })
    save_config(cfg, out_dir, {"trainer": "acceptance", "target": str(target_dir), "draft": str(draft_dir), "data": [str(f) for f in data_files]})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def weighted_bce(logits, labels, reject_weight: float):
    """Soft-label BCE, the reject class weighted: -(y log s + w (1 - y) log(1 - s))."""
    import torch.nn.functional as F

    return -(labels * F.logsigmoid(logits) + reject_weight * (1 - labels) * F.logsigmoid(-logits)).mean()


class TensorDict:
    """A map-style dataset of equal-length tensors (one dict per item)."""

    def __init__(self, **tensors):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}


def calibration(pred, labels, bins: int = 10) -> dict:
    """Brier score against the soft labels, a constant-predictor baseline, and reliability bins."""
    import torch

    brier = float(((pred - labels) ** 2).mean())
    base = float(((labels.mean() - labels) ** 2).mean())
    edges = torch.linspace(0, 1, bins + 1)
    table = []
    for b in range(bins):
        lo, hi = edges[b], edges[b + 1]
        sel = (pred >= lo) & ((pred < hi) if b < bins - 1 else (pred <= hi))
        if sel.any():
            table.append({"lo": float(lo), "hi": float(hi), "count": int(sel.sum()), "mean_pred": float(pred[sel].mean()), "mean_label": float(labels[sel].mean())})
    ece = sum(r["count"] * abs(r["mean_pred"] - r["mean_label"]) for r in table) / max(1, len(pred))
    return {"brier": brier, "brier_constant_baseline": base, "ece": ece, "reliability_bins": table, "mean_label": float(labels.mean())}


def read_policy_prompts(path: str | Path, tokenizer, limit: int = POLICY_PROMPTS) -> list[list[int]]:
    """Token ids of the first ``limit`` usable prompts of a prompts JSONL (decode's input format)."""
    from specdec.decode.jobs.io import read_records
    from specdec.decode.jobs.job import encode_record

    if not Path(path).exists():
        raise UsageError(f"no such prompts file: {path}")
    out = []
    for rec in read_records(path):
        if rec.error:
            raise UsageError(f"{path}:{rec.line}: {rec.error}")
        try:
            ids = encode_record(tokenizer, rec)
        except ValueError as exc:  # e.g. messages without a chat template
            raise UsageError(f"{path}:{rec.line}: cannot tokenize: {exc}") from exc
        if ids:
            out.append(ids)
        if len(out) >= limit:
            break
    if not out:
        raise UsageError(f"{path} holds no prompts")
    return out
