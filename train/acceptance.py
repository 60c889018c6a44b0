"""train-acceptance: the SpecDec++ acceptance head on a draft's last hidden state.

The head predicts P(draft token accepted | earlier drafts accepted) from what the draft knows when
it proposes the token: its last hidden state at the position that produced q, and three statistics
of q there (q(x) of the proposed token, max q, entropy). The stop decision therefore needs no draft
forward of the token itself: a round that stops costs exactly the forwards of a fixed-length round.
Training label (SpecDec++, Huang et al. 2024): min(1, p(x)/q(x)) on the draft's own sampled
token x (15% of positions use a token of the target instead); soft-label BCE with the reject class
up-weighted (x6 in the paper's code). Draft and target are frozen, so the features and labels are
computed once and the loop trains only the head.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from specdec.decode.artifacts import SpecdecError, UsageError, check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.decode.adaptive import FEATURES, N_STATS, acceptance_features
from specdec.train.loop import TrainConfig, run_training, save_config


def _nn():
    import torch

    class ResBlock(torch.nn.Module):
        """x + SiLU(W x + b), W zero-initialised so a fresh block is the identity (Medusa)."""

        def __init__(self, hidden: int):
            super().__init__()
            self.linear = torch.nn.Linear(hidden, hidden)
            torch.nn.init.zeros_(self.linear.weight)

        def forward(self, x):
            return x + torch.nn.functional.silu(self.linear(x))

    class AcceptanceHead(torch.nn.Module):
        """ResBlock x num_layers then Linear(H, 1): a logit of P(accept)."""

        def __init__(self, hidden: int, num_layers: int = 3):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])
            self.out = torch.nn.Linear(hidden, 1)

        def forward(self, h):
            return self.out(self.blocks(h)).squeeze(-1)

    return ResBlock, AcceptanceHead


def ResBlock(hidden: int):
    return _nn()[0](hidden)


def AcceptanceHead(hidden: int, num_layers: int = 3):
    return _nn()[1](hidden, num_layers)


# ---------------------------------------------------------------------------------------------
# Labels


def acceptance_labels(p_probs, q_probs, tokens):
    """min(1, p(x)/q(x)) per position: p_probs, q_probs [..., V] (same temperature), tokens [...].

    The probability that exact speculative sampling accepts a drafted x; 1 where q(x) = 0 is
    impossible for a drafted token but is clamped anyway (a target-chosen token q never proposed).
    """
    import torch

    px = p_probs.gather(-1, tokens[..., None]).squeeze(-1)
    qx = q_probs.gather(-1, tokens[..., None]).squeeze(-1)
    return torch.where(qx > 0, (px / qx.clamp(min=1e-30)).clamp(max=1.0), torch.ones_like(px))


def propose_tokens(p_probs, q_probs, target_frac: float, generator):
    """The token judged at each position: sampled from q, or (target_frac of positions) from p."""
    import torch

    flat_q = q_probs.reshape(-1, q_probs.shape[-1])
    flat_p = p_probs.reshape(-1, p_probs.shape[-1])
    from_q = torch.multinomial(flat_q, 1, generator=generator).squeeze(-1)
    from_p = torch.multinomial(flat_p, 1, generator=generator).squeeze(-1)
    use_p = torch.rand(from_q.shape, generator=generator) < target_frac
    return torch.where(use_p, from_p, from_q).reshape(q_probs.shape[:-1]), use_p.reshape(q_probs.shape[:-1])


def weighted_bce(logits, labels, reject_weight: float):
    """Soft-label BCE, the reject class weighted: -(y log s + w (1 - y) log(1 - s))."""
    import torch.nn.functional as F

    return -(labels * F.logsigmoid(logits) + reject_weight * (1 - labels) * F.logsigmoid(-logits)).mean()


def build_features(draft, target, blocks, temperature: float, target_frac: float, seed: int, batch: int = 8, deadline: float | None = None):
    """(hidden [N, H], label [N]) over the judged positions of ``blocks``.

    With a ``deadline`` (a ``time.perf_counter()`` value) labelling stops at the first batch boundary
    after it, so a budgeted run spends its minutes on training rather than labelling the whole corpus.
    """
    import time

    import torch

    g = torch.Generator().manual_seed(seed)
    feats, labels = [], []
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            if deadline is not None and feats and time.perf_counter() > deadline:
                break
            ids = blocks[i : i + batch]["input_ids"]
            out = draft(input_ids=ids, output_hidden_states=True)
            q_logits = out.logits.float()[:, :-1]  # position t proposes token t+1
            q = torch.softmax(q_logits / temperature, -1)
            p = torch.softmax(target(input_ids=ids).logits.float()[:, :-1] / temperature, -1)
            tokens, _ = propose_tokens(p, q, target_frac, g)
            labels.append(acceptance_labels(p, q, tokens).flatten())
            f = acceptance_features(out.hidden_states[-1][:, :-1], q_logits, tokens)
            feats.append(f.reshape(-1, f.shape[-1]))
    return torch.cat(feats), torch.cat(labels)


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


def train_acceptance(
    target_dir: str | Path,
    draft_dir: str | Path,
    data_files: list[str | Path],
    out_dir: str | Path,
    cfg: TrainConfig,
    num_layers: int = 3,
    reject_weight: float = 6.0,
    target_token_frac: float = 0.15,
    temperature: float = 1.0,
    resume: bool = False,
) -> dict:
    import torch
    from safetensors.torch import save_file

    from specdec.train.data import load_blocks
    from specdec.train.draft import load_draft, load_target
    from specdec.train.loop import make_accelerator

    if temperature <= 0 or not 0 <= target_token_frac <= 1 or reject_weight <= 0:
        raise UsageError("temperature and reject_weight must be > 0 and target_token_frac in [0, 1]")
    out_dir = Path(out_dir)
    target, tokenizer = load_target(target_dir)
    fp = tokenizer_fingerprint(tokenizer)
    dcfg = read_config(draft_dir)
    if "specdec_target" in dcfg:
        check_fingerprint(dcfg["specdec_target"], fp, f"draft {draft_dir}")
    draft = load_draft(draft_dir)
    draft.requires_grad_(False)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecdecError(f"draft {draft_dir} has vocabulary size {draft.config.vocab_size}, the target {target.config.vocab_size}")
    accelerator = make_accelerator(cfg)
    start = time.perf_counter()
    train_blocks, held_blocks = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    budget_s = cfg.budget_minutes * 60
    # under a budget: at most 40% of it labels training positions, 10% labels held-out ones
    h_train, y_train = build_features(draft, target, train_blocks, temperature, target_token_frac, cfg.seed,
                                      deadline=start + 0.4 * budget_s if budget_s else None)
    h_held, y_held = build_features(draft, target, held_blocks, temperature, target_token_frac, cfg.seed + 1,
                                    deadline=time.perf_counter() + 0.1 * budget_s if budget_s else None)
    if budget_s:  # the training loop gets what is left
        cfg = dataclasses.replace(cfg, budget_minutes=max(budget_s - (time.perf_counter() - start), 0.2 * budget_s) / 60)
    hidden = draft.config.hidden_size
    torch.manual_seed(cfg.seed)
    head = AcceptanceHead(hidden + N_STATS, num_layers)

    def loss_fn(model, batch):
        return weighted_bce(model(batch["h"]).float(), batch["y"], reject_weight)

    result = run_training(cfg, head, loss_fn, TensorDict(h=h_train, y=y_train), out_dir, resume=resume, accelerator=accelerator)
    if not result.is_main:
        return {}
    head = result.model.float()
    with torch.no_grad():
        # weighted BCE's optimum is odds(s) = odds(y) / w; the saved head adds log w back (calibrated)
        head.out.bias += math.log(reject_weight)
        pred = torch.sigmoid(head(h_held))
        raw = torch.sigmoid(head(h_held) - math.log(reject_weight))
    metrics = calibration(pred, y_held)
    metrics["uncorrected_brier"] = float(((raw - y_held) ** 2).mean())
    metrics.update(kind="acceptance", steps=result.steps, stopped=result.stopped, train_wall_s=round(result.wall_s, 3),
                   loss_curve=result.losses, heldout_positions=len(y_held), train_positions=len(y_train),
                   note="Brier against the soft labels min(1, p/q) on held-out draft samples. Training up-weights the "
                        "reject class by w; the saved head's output bias includes + log w, which undoes that shift "
                        "(uncorrected_brier is the head without it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(out_dir / "model.safetensors"))
    write_json(out_dir / "config.json", {
        "kind": "acceptance", "target": fp,
        "draft": {"path": str(Path(draft_dir).resolve()), "fingerprint": dcfg.get("specdec_target", fp), "hidden_size": hidden},
        "hidden_size": hidden, "features": FEATURES, "input_size": hidden + N_STATS, "num_layers": num_layers, "reject_weight": reject_weight,
        "target_token_frac": target_token_frac, "temperature": temperature,
    })
    save_config(cfg, out_dir, {"trainer": "acceptance", "target": str(target_dir), "draft": str(draft_dir), "data": [str(f) for f in data_files]})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def load_acceptance_head(acceptance_dir: str | Path):
    """(head, config) from an acceptance artifact; weights through safetensors only."""
    from safetensors.torch import load_file

    cfg = read_config(acceptance_dir)
    if cfg.get("kind") != "acceptance":
        raise SpecdecError(f"{acceptance_dir} is not an acceptance artifact (kind {cfg.get('kind')!r})")
    if cfg.get("features") != FEATURES:
        raise SpecdecError(f"{acceptance_dir} is an acceptance head of an older format (it reads the hidden state of the "
                           f"drafted token itself); retrain it with `specdec train-acceptance`")
    head = AcceptanceHead(int(cfg["input_size"]), int(cfg.get("num_layers", 3)))
    head.load_state_dict(load_file(str(Path(acceptance_dir) / "model.safetensors")))
    return head.eval().requires_grad_(False), cfg
