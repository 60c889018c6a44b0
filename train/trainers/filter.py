"""Learn2PD: train the tiny filter that tells which current dLLM predictions are already final.

Labels come from an oracle run: decode each prompt once with static one-token-per-step decoding
(the reference), then re-decode committing at every step each masked position whose prediction
already equals the reference, and log (block confidences, is-correct) per step. The filter is a
logistic regression (``hidden=0``, as in the public code) or a one-hidden-layer MLP over the
block's top-1 confidences, trained with BCE and AdamW (lr 3e-3) on specdec's one training loop.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.decode.diffusion.generator import DiffusionGenerator
from specdec.models.artifacts import tokenizer_fingerprint, write_json
from specdec.models.dllm import ConfidenceFilter, encode_prompt, save_filter
from specdec.models.errors import SpecdecError
from specdec.decode.engine.types import GenRequest
from specdec.train.settings import FilterSettings, check_by_name
from specdec.train.trainers.dllm import curve_summary


@dataclass
class FilterTrainConfig:
    gen_length: int = 128
    block_size: int = 32
    hidden: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.01
    max_steps: int = 2000
    batch_size: int = 256  # logged steps per optimizer step
    decode_batch_size: int = 16
    heldout_fraction: float = 0.1
    threshold: float = 0.96  # the commit threshold learn2pd uses at inference
    budget_minutes: float | None = None
    labelling_share: float = 0.6  # under a budget, no labelling batch starts after this share of it
    cache: str = "none"  # of the labelling decodes; "prefix" is the same computation under block attention, up to rounding
    seed: int = 0
    # checkpoints under OUT/checkpoints every N optimizer steps (0: only at the end; None: none, nothing to resume)
    checkpoint_every: int | None = None

    def __post_init__(self):
        check_by_name(FilterSettings, self)  # where they are declared (train.settings)


@dataclass
class FilterData:
    features: Tensor  # [S, W] block confidences (decided positions read 1.0)
    labels: Tensor  # [S, W] 1 where the prediction already equals the reference
    weight: Tensor  # [S, W] 1 where the position was still masked (only those are supervised)
    prompts: int = 0  # prompts whose decodes were labelled

    def __len__(self) -> int:
        return self.features.shape[0]

    def take(self, idx: Tensor) -> "FilterData":
        return FilterData(self.features[idx], self.labels[idx], self.weight[idx])

    def __getitem__(self, i: int) -> dict[str, Tensor]:  # one logged step, for the training loop's batches
        return {"features": self.features[i], "labels": self.labels[i], "weight": self.weight[i]}


def reference_canvas(results, gen_length: int, eos_id: int | None) -> list[list[int]]:
    """The static decode's full canvas: answer tokens, then EOS to the end when it stopped."""
    return [r.token_ids + [eos_id] * (gen_length - len(r.token_ids)) if r.finish_reason == "stop" else r.token_ids for r in results]


def collect_filter_data(model, tokenizer, spec, prompts: list[str], cfg: FilterTrainConfig, deadline: float | None = None) -> FilterData:
    """Labelled steps of oracle decodes; with a ``deadline`` (time.monotonic()) no batch starts after it (one always runs)."""
    static = DiffusionGenerator(model, tokenizer, spec, "static", gen_length=cfg.gen_length, block_size=cfg.block_size, cache=cfg.cache)
    feats, labels, weights = [], [], []
    labelled = 0
    for i in range(0, len(prompts), cfg.decode_batch_size):
        if feats and deadline is not None and time.monotonic() > deadline:
            break
        labelled += len(prompts[i : i + cfg.decode_batch_size])
        requests = [GenRequest(encode_prompt(tokenizer, p), cfg.gen_length) for p in prompts[i : i + cfg.decode_batch_size]]
        reference = torch.tensor(reference_canvas(static.generate(requests), cfg.gen_length, spec.eos_token_id), device=model.device)
        log: list = []
        oracle = DiffusionGenerator(
            model, tokenizer, spec, "oracle", gen_length=cfg.gen_length, block_size=cfg.block_size, cache=cfg.cache, reference=reference, log=log
        )
        oracle.generate(requests)
        for f, y, w in log:
            pad = (0, cfg.block_size - f.shape[-1])
            feats.append(F.pad(f, pad, value=1.0))
            labels.append(F.pad(y, pad))
            weights.append(F.pad(w.float(), pad))
    if not feats:
        raise SpecdecError("no filter training data: give at least one prompt")
    return FilterData(torch.cat(feats), torch.cat(labels), torch.cat(weights), labelled)


def bce(filt: ConfidenceFilter, data: FilterData) -> Tensor:
    loss = F.binary_cross_entropy_with_logits(filt(data.features), data.labels, weight=data.weight, reduction="sum")
    return loss / data.weight.sum().clamp(min=1)


@torch.no_grad()
def evaluate(filt: ConfidenceFilter, data: FilterData, threshold: float) -> dict:
    """BCE, plus precision/recall of 'commit' decisions at the inference threshold (masked positions only)."""
    if len(data) == 0:
        return {}
    commit = (torch.sigmoid(filt(data.features)) > threshold) & (data.weight > 0)
    positives = (data.labels > 0) & (data.weight > 0)
    return {
        "bce": float(bce(filt, data)),
        "precision": float((commit & positives).sum() / commit.sum().clamp(min=1)),
        "recall": float((commit & positives).sum() / positives.sum().clamp(min=1)),
        "positive_rate": float(positives.sum() / (data.weight > 0).sum().clamp(min=1)),
    }


def fit_filter(data: FilterData, cfg: FilterTrainConfig, out_dir: str | Path | None = None, resume: bool = False) -> tuple[ConfidenceFilter, dict]:
    """Fit the filter on ``data`` (a held-out share kept for metrics); with ``cfg.checkpoint_every`` set,
    checkpoints go under ``out_dir/checkpoints`` and ``resume`` goes on from the newest complete one."""
    from specdec.train.loop import TrainConfig, run_training

    torch.manual_seed(cfg.seed)
    order = torch.randperm(len(data))
    n_heldout = int(len(data) * cfg.heldout_fraction)
    heldout, train = data.take(order[:n_heldout]), data.take(order[n_heldout:])
    filt = ConfidenceFilter(cfg.block_size, cfg.hidden)
    # fp32 and no clipping, as the filter is a few hundred weights; the cosine follows the clock under a budget
    loop = TrainConfig(
        lr=cfg.lr, steps=cfg.max_steps, batch=min(cfg.batch_size, len(train)), seq_len=cfg.block_size, warmup=0,
        weight_decay=cfg.weight_decay, betas=(0.9, 0.999), clip=0.0, seed=cfg.seed, checkpoint_every=cfg.checkpoint_every or 0,
        save_final_checkpoint=cfg.checkpoint_every is not None, budget_minutes=cfg.budget_minutes or 0.0, clock_schedule=True,
        mixed_precision="no", progress=False,
    )  # fmt: skip
    loss_fn = lambda model, batch: bce(model, FilterData(batch["features"], batch["labels"], batch["weight"]))  # noqa: E731
    if cfg.checkpoint_every is None or out_dir is None:
        with tempfile.TemporaryDirectory() as scratch:  # nothing is written there (no checkpoints)
            res = run_training(loop, filt, loss_fn, train, scratch, label="filter")
    else:
        res = run_training(loop, filt, loss_fn, train, out_dir, resume=resume, label="filter")
    filt = res.model.cpu()
    return filt, {**curve_summary(res.losses, res.wall_s), "heldout": evaluate(filt, heldout, cfg.threshold), "train_records": len(train)}


def train_filter(
    dllm_dir: str | Path,
    prompts: list[str],
    out_dir: str | Path,
    gen_length: int = 128,
    block_size: int = 32,
    hidden: int = 0,
    max_steps: int = 2000,
    budget_minutes: float | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    cache: str = "none",
    placement=None,
    resume: bool = False,
    checkpoint_every: int | None = None,
) -> dict:
    """Label oracle decodes of ``prompts`` with the dLLM in ``dllm_dir``, fit the filter, write the artifact.

    The dLLM loads as ``specdec decode`` loads it, placed by ``placement`` (models.loading.Placement;
    default: ``trust_remote_code`` alone). ``checkpoint_every`` writes checkpoints of the filter's fit
    under ``out_dir/checkpoints``; ``resume`` labels again (the same decodes) and goes on from the newest
    complete one."""
    from specdec.decode.diffusion.generator import load_for_decoding
    from specdec.decode.options import DecodeOptions

    cfg = FilterTrainConfig(
        gen_length=gen_length, block_size=block_size, hidden=hidden, max_steps=max_steps, budget_minutes=budget_minutes, seed=seed, cache=cache,
        checkpoint_every=checkpoint_every,
    )  # fmt: skip
    options = DecodeOptions(placement=placement, trust_remote_code=trust_remote_code or bool(placement and placement.trust_remote_code),
                            batch_size=cfg.decode_batch_size, max_new_tokens=gen_length)
    model, tokenizer, spec = load_for_decoding(dllm_dir, options)
    started = time.monotonic()
    deadline = None if budget_minutes is None else started + 60 * budget_minutes * cfg.labelling_share
    data = collect_filter_data(model, tokenizer, spec, prompts, cfg, deadline)
    labelling = time.monotonic() - started
    if budget_minutes is not None:  # labelling spent part of the budget
        cfg.budget_minutes = max(0.05, budget_minutes - labelling / 60)
    filt, metrics = fit_filter(data, cfg, out_dir, resume)
    metrics = {"records": len(data), "prompts": data.prompts, "labelling_seconds": round(labelling, 2), **metrics}
    save_filter(filt, out_dir, {"dllm": str(dllm_dir), "target": tokenizer_fingerprint(tokenizer), "threshold": cfg.threshold, "block_size": block_size})
    write_json(Path(out_dir) / "metrics.json", metrics)
    write_json(Path(out_dir) / "train_config.json", asdict(cfg))
    return metrics
