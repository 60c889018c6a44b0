"""train-lud: Lexical Unit Decoding's fine-tuning. A LoRA on the target's attention projections teaches it
to predict, at a position, the next ``m`` tokens (a lexical unit): the input is a text's tokens x_1..x_t
followed by ``m - 1`` placeholder tokens, and the labels at the last real position and at each placeholder
are x_{t+1}..x_{t+m}. ``decode.approx.lud`` decodes with it.

Packing: one forward per training block covers every cut point drawn for it. A block of L tokens is
followed by K placeholder groups of ``m - 1`` tokens, one per cut t (``cuts`` of them, drawn without
replacement among the cuts whose unit lies in the block, seeded per micro-batch, so a resumed run draws
what an uninterrupted one would); a 4-D attention
mask lets the block's tokens attend causally among themselves and a group's placeholders attend to
x_1..x_t and to the placeholders of their own group before them, at position ids t, t+1, ..., so each
group computes exactly what the input x_1..x_t + placeholders would. Blocks are cut from the middle of
documents and start, as every trainer's do, with the tokens the tokenizer puts in front of a prompt
(``train.data.block_prefix``: Gemma's BOS); their next-token predictions (a document's middle from BOS
alone) are not learnt, and no unit starts before a real token. The block's own positions keep the
ordinary next-token loss (weight ``ntp_weight``), so the model's plain predictions stay good; the unit
loss is the mean cross-entropy of the K*m unit predictions.

The placeholder is one token the tokenizer rarely uses (``choose_placeholder``); the artifact records it.
The target stays frozen; only the LoRA trains, through the shared loop (resume, budget, precision). Its
checkpoints hold the adapter's tensors and the optimizer's state only (``AdapterOnly``), not the frozen
target's weights.

Artifact: a peft adapter folder (adapter_config.json, adapter_model.safetensors) with config.json
``{specdec_kind: "lud", unit_size, placeholder_id, lora, specdec_target, base_model}``, metrics.json
(held-out unit accuracy before and after) and the resolved training config.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models.artifacts import tokenizer_fingerprint, write_json
from specdec.models.errors import SpecdecError, UsageError
from specdec.train.loop import StepSeeded, TrainConfig, run_training, save_config
from specdec.train.settings import LudSettings

KIND = "lud"
# the default recipe (no --recipe): small enough for Gemma 3 270M on a 2-core CPU. A recipe's ``lud:``
# section (or the whole file) replaces it; the trainer's settings (train.settings.LudSettings) go under ``extra``.
EVAL_BLOCKS = 32  # held-out blocks the before/after metrics read at most


# ---------------------------------------------------------------------------------------------
# The placeholder


def choose_placeholder(tokenizer, model_vocab: int | None = None) -> int:
    """The placeholder token: one id a tokenizer's text never produces and the model does not need to say.

    In order: the pad token (Gemma's ``<pad>``); the first vocabulary entry named unused/reserved
    (``<unused0>``, ``<|reserved_special_token_0|>``); the unknown token; never EOS or BOS (they do occur in
    text: between documents, at the start). None fits: an error asking for ``extra.placeholder_id``."""
    avoid = {i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id) if i is not None}
    limit = model_vocab if model_vocab is not None else len(tokenizer)

    def fits(i) -> bool:
        return isinstance(i, int) and 0 <= i < limit and i not in avoid

    if fits(tokenizer.pad_token_id):
        return int(tokenizer.pad_token_id)
    vocab = tokenizer.get_vocab()
    named = sorted(i for t, i in vocab.items() if ("unused" in t.lower() or "reserved" in t.lower()) and fits(i))
    if named:
        return named[0]
    if fits(tokenizer.unk_token_id):
        return int(tokenizer.unk_token_id)
    raise SpecdecError("no placeholder token for lexical units: the tokenizer has no pad, unused/reserved or unknown token "
                       "other than EOS/BOS; set one in the recipe (extra: {placeholder_id: N})")


# ---------------------------------------------------------------------------------------------
# Packed batches


def pack(ids: torch.Tensor, cuts: torch.Tensor, unit_size: int, placeholder: int, skip: int = 0) -> dict:
    """The packed training input of blocks ``ids`` [B, L] with cut points ``cuts`` [B, K] (each in 1..L-m:
    the number of real tokens before a group of m-1 placeholders). ``skip``: the first positions' next
    tokens are not learnt (the BOS a block cut from the middle of a document starts with).

    Returns input_ids and position_ids [B, T] (T = L + K(m-1)), visible [B, T, T] (which keys each query
    attends to), ntp_labels [B, T] (the next token at the block's positions, -100 elsewhere), unit_pos and
    unit_labels [B, K*m] (where each unit's m predictions are read and what they should say)."""
    bsz, length = ids.shape
    m, k = unit_size, cuts.shape[1]
    g = m - 1
    t = length + k * g
    device = ids.device
    arange_g = torch.arange(g, device=device)
    inputs = torch.cat([ids, torch.full((bsz, k * g), placeholder, dtype=ids.dtype, device=device)], 1)
    ph_pos = (cuts[:, :, None] + arange_g).reshape(bsz, k * g)  # placeholder j (0-based) of cut c: position c + j
    positions = torch.cat([torch.arange(length, device=device).expand(bsz, -1), ph_pos], 1)
    visible = torch.zeros(bsz, t, t, dtype=torch.bool, device=device)
    visible[:, :length, :length] = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    # a placeholder sees the real tokens before its cut and its own group up to itself
    real = torch.arange(length, device=device)
    sees_real = real[None, None, :] < cuts.repeat_interleave(g, dim=1)[:, :, None]  # [B, K*g, L]
    visible[:, length:, :length] = sees_real
    own = torch.ones(g, g, dtype=torch.bool, device=device).tril()
    for i in range(k):
        lo = length + i * g
        visible[:, lo : lo + g, lo : lo + g] = own
    ntp = torch.full((bsz, t), -100, dtype=torch.long, device=device)
    ntp[:, : length - 1] = ids[:, 1:]
    ntp[:, :skip] = -100
    first = cuts - 1  # the last real position predicts the unit's first token
    ph_idx = length + (torch.arange(k, device=device)[:, None] * g + arange_g).reshape(1, k, g).expand(bsz, -1, -1)
    unit_pos = torch.cat([first[:, :, None], ph_idx], 2).reshape(bsz, k * m)
    label_idx = (cuts[:, :, None] + torch.arange(m, device=device)).reshape(bsz, k * m)
    unit_labels = ids.gather(1, label_idx)
    return {"input_ids": inputs, "position_ids": positions, "visible": visible, "ntp_labels": ntp,
            "unit_pos": unit_pos, "unit_labels": unit_labels}


def draw_cuts(bsz: int, length: int, unit_size: int, count: int, generator: torch.Generator, low: int = 1) -> torch.Tensor:
    """[B, K] distinct cut points per block in low..L-m (K = min(count, their number))."""
    span = length - unit_size - low + 1
    if span < 1:
        raise UsageError(f"--seq-len {length} leaves no room for a unit of {unit_size} tokens: use a longer block")
    k = max(1, min(count, span))
    return torch.rand(bsz, span, generator=generator).argsort(-1)[:, :k] + low


class LudCollate(StepSeeded):
    """Stacks a micro-batch's blocks and packs them with cut points drawn for that micro-batch. A block's
    first ``skip`` tokens are the prefix every block starts with (``train.data.block_prefix``): their next
    tokens are not learnt and each unit follows at least one token after them."""

    def __init__(self, seed: int, unit_size: int, cuts: int, placeholder: int, skip: int = 0, copies: int = 1):
        super().__init__(seed)
        self.unit_size, self.cuts, self.placeholder, self.skip = unit_size, cuts, placeholder, int(skip)
        self.copies = int(copies)  # groups per cut, in a row (PPD's ensemble: each sees the cut's text, not the others)

    def __call__(self, items) -> dict:
        _, gen = self.draw()
        return self.make(torch.stack([it["input_ids"] for it in items]), gen)

    def make(self, ids: torch.Tensor, generator: torch.Generator) -> dict:
        ids = ids.long()
        cuts = draw_cuts(ids.shape[0], ids.shape[1], self.unit_size, self.cuts, generator, low=self.skip + 1)
        return pack(ids, cuts.repeat_interleave(self.copies, dim=1), self.unit_size, self.placeholder, skip=self.skip)


class MaskMaker:
    """The 4-D additive mask(s) a model takes for a packed batch: one mask, or per layer type where full and
    sliding-window layers mix (a key is visible to a sliding layer's query iff their positions are less
    than the window apart), as ``decode.engine.cache`` builds them."""

    def __init__(self, config, dtype: torch.dtype):
        from specdec.models import arch

        types, window = arch.layer_types(config), arch.sliding_window(config)
        self.window = window if window is not None and arch.SLIDING in types else None
        self.mixed = self.window is not None and arch.FULL in types
        self.dtype = dtype

    def __call__(self, visible: torch.Tensor, positions: torch.Tensor):
        from specdec.models import arch
        from specdec.models.masks import additive_mask

        vis = visible[:, None]
        mask = additive_mask(vis, self.dtype)
        if self.window is None:
            return mask
        near = (positions[:, :, None] - positions[:, None, :]) < self.window
        sliding = additive_mask(vis & near[:, None], self.dtype)
        return {arch.FULL: mask, arch.SLIDING: sliding} if self.mixed else sliding


def lud_forward(model, batch: dict, masks: MaskMaker):
    return model(input_ids=batch["input_ids"], attention_mask=masks(batch["visible"], batch["position_ids"]),
                 position_ids=batch["position_ids"]).logits


def lud_losses(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit loss, next-token loss) of a packed batch's logits [B, T, V]."""
    vocab = logits.shape[-1]
    pos = batch["unit_pos"]
    picked = logits.gather(1, pos[..., None].expand(-1, -1, vocab)).float()
    unit = F.cross_entropy(picked.reshape(-1, vocab), batch["unit_labels"].reshape(-1))
    ntp = F.cross_entropy(logits.float().reshape(-1, vocab), batch["ntp_labels"].reshape(-1), ignore_index=-100)
    return unit, ntp


def unit_loss(model, batch: dict, masks: MaskMaker | None = None) -> float:
    """The unit loss of ``model`` (a causal LM, with or without the adapter) on a packed batch, no gradient."""
    masks = masks or MaskMaker(model.config, next(model.parameters()).dtype)
    device = model.get_input_embeddings().weight.device
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        return float(lud_losses(lud_forward(model, batch, masks), batch)[0])


# ---------------------------------------------------------------------------------------------
# The trainable module


class AdapterOnly(torch.nn.Module):
    """A peft model whose state dict is its trainable (LoRA) tensors only: the loop's checkpoints hold the
    adapter, not another copy of the frozen target (1 GB for Gemma 3 270M). Loading such a state dict
    reports the frozen weights as present."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self._trainable = {f"model.{n}" for n, p in model.named_parameters() if p.requires_grad}
        self.register_load_state_dict_post_hook(AdapterOnly._frozen_are_not_missing)

    def forward(self, **kwargs):
        return self.model(**kwargs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        full = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        kept = OrderedDict((k, v) for k, v in full.items() if k[len(prefix):] in self._trainable)
        if destination is None:
            return kept
        destination.update(kept)
        return destination

    @staticmethod
    def _frozen_are_not_missing(module, incompatible) -> None:
        trainable = module._trainable
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                        if k in trainable or any(k.endswith("." + t) for t in trainable)]


def add_lora(target, rank: int, alpha: float):
    """The target wrapped by peft with a LoRA on every attention projection (the target's weights frozen)."""
    from peft import LoraConfig, get_peft_model

    from specdec.models.arch import attention_projections

    names = attention_projections(target)
    if not names:
        raise SpecdecError("found no attention projections in the target to put the LoRA on")
    target.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, bias="none")
    return get_peft_model(target, config), names


# ---------------------------------------------------------------------------------------------
# Metrics


def evaluate_units(model, held, collate: LudCollate, masks: MaskMaker, seed: int, batch: int = 4, threshold: float = 0.9) -> dict:
    """On up to EVAL_BLOCKS held-out blocks with fixed cut points: the unit's cross-entropy, top-1 accuracy
    per offset (0 = the ordinary next token), the next-token CE on the blocks, and the tokens a decoding step
    would emit at ``threshold`` when fed the true prefix (1 + the leading offsets >= 1 whose probability
    clears it), with the share of those extra tokens that match the text."""
    n = min(len(held), EVAL_BLOCKS)
    if n == 0:
        return {}
    gen = torch.Generator().manual_seed(seed + 7919)
    device = next(model.parameters()).device
    m = collate.unit_size
    hits = torch.zeros(m)
    total = 0
    unit_ce, ntp_ce, steps, emitted, extra_ok, extra = 0.0, 0.0, 0, 0, 0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            ids = held[i : min(i + batch, n)]["input_ids"]
            b = {k: v.to(device) for k, v in collate.make(ids, gen).items()}
            logits = lud_forward(model, b, masks)
            u, t = lud_losses(logits, b)
            rows = ids.shape[0]
            unit_ce += float(u) * rows
            ntp_ce += float(t) * rows
            picked = logits.gather(1, b["unit_pos"][..., None].expand(-1, -1, logits.shape[-1])).float()
            probs = picked.softmax(-1).reshape(rows, -1, m, logits.shape[-1])
            p, top = probs.max(-1)  # [B, K, m]
            labels = b["unit_labels"].reshape(rows, -1, m)
            right = (top == labels).cpu()
            hits += right.sum((0, 1)).float()
            total += right.shape[0] * right.shape[1]
            ok = (p[..., 1:] >= threshold).cpu().long().cumprod(-1)  # leading offsets that clear the threshold
            steps += ok.shape[0] * ok.shape[1]
            emitted += int(ok.sum()) + ok.shape[0] * ok.shape[1]
            extra += int(ok.sum())
            extra_ok += int((ok.bool() & right[..., 1:]).sum())
    model.train(was_training)
    return {
        "unit_ce": unit_ce / n,
        "ntp_ce": ntp_ce / n,
        "unit_accuracy": (hits / max(total, 1)).tolist(),
        "tokens_per_step_teacher_forced": emitted / max(steps, 1),
        "extra_token_accuracy": extra_ok / extra if extra else None,
        "threshold": threshold,
        "heldout_blocks": n,
    }


# ---------------------------------------------------------------------------------------------
# The trainer


def train_lud(
    target_dir: str | Path,
    data_files: list[str | Path],
    out_dir: str | Path,
    cfg: TrainConfig,
    unit_size: int | None = None,
    resume: bool = False,
    placement=None,
    **knobs,
) -> dict:
    """Fine-tune the target for lexical units and write the artifact; returns metrics (empty on the
    non-main processes). ``knobs`` (else ``cfg.extra``, else their declared defaults): ``LudSettings`` by name."""
    from specdec.models.loading import resolve_source
    from specdec.train.data import block_prefix, load_blocks, load_teacher
    from specdec.train.loop import make_accelerator

    known = {f.name for f in fields(LudSettings)}
    unknown = sorted(set(cfg.extra) - known)
    if unknown:
        raise UsageError(f"unknown lud recipe knob(s) under extra: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    given = {k: v for k, v in {**knobs, "unit_size": unit_size}.items() if v is not None}
    settings = LudSettings(**{**cfg.extra, **given})
    settings.check()
    hp = asdict(settings)
    m = settings.unit_size
    out_dir = Path(out_dir)
    accelerator = make_accelerator(cfg)
    target, tokenizer = load_teacher(target_dir, placement, accelerator)
    prefix = block_prefix(tokenizer)
    if cfg.seq_len < len(prefix) + m + 1:
        raise UsageError(f"--seq-len {cfg.seq_len} leaves no room for a unit of {m} tokens: use at least "
                         f"{len(prefix) + m + 1} (the {len(prefix)}-token prefix every block starts with, a token, the unit)")
    fp = tokenizer_fingerprint(tokenizer)
    vocab = target.get_input_embeddings().weight.shape[0]
    placeholder = settings.placeholder_id
    placeholder = choose_placeholder(tokenizer, vocab) if placeholder is None else placeholder
    if not 0 <= placeholder < vocab:
        raise UsageError(f"placeholder_id {placeholder} is outside the target's vocabulary ({vocab})")
    train, held = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    torch.manual_seed(cfg.seed)
    peft_model, names = add_lora(target, settings.lora_rank, float(settings.lora_alpha))
    masks = MaskMaker(target.config, target.dtype)
    ntp_weight = float(settings.ntp_weight)
    collate = LudCollate(cfg.seed, m, settings.cuts, placeholder, skip=len(prefix))
    before = evaluate_units(peft_model, held, collate, masks, cfg.seed) if accelerator.is_main_process else {}

    def loss_fn(model, batch):
        unit, ntp = lud_losses(lud_forward(model, batch, masks), batch)
        loss = unit + ntp_weight * ntp if ntp_weight else unit
        return loss, {"unit": float(unit.detach()), "ntp": float(ntp.detach())}

    result = run_training(cfg, AdapterOnly(peft_model), loss_fn, train, out_dir, resume=resume, accelerator=accelerator,
                          collate_fn=collate, label="lud")
    if not result.is_main:
        return {}
    trained = result.model.model
    after = evaluate_units(trained, held, collate, masks, cfg.seed)
    metrics = {
        "kind": KIND, "unit_size": m, "placeholder_id": placeholder, "block_prefix": prefix, "steps": result.steps, "stopped": result.stopped,
        "train_wall_s": round(result.wall_s, 3), "loss_curve": result.losses,
        "final_loss": result.losses[-1] if result.losses else None,
        "train_tokens": result.steps * cfg.batch * cfg.grad_accum * cfg.seq_len * accelerator.num_processes,
        "lora_parameters": sum(p.numel() for p in trained.parameters() if p.requires_grad),
        "heldout_before": before, "heldout": after,
        "unit_accuracy": after.get("unit_accuracy"), "unit_ce": after.get("unit_ce"),
    }
    lora = {"r": settings.lora_rank, "lora_alpha": float(settings.lora_alpha), "target_modules": names, "dropout": 0.0}
    save_lud(trained, out_dir, fp, m, placeholder, tokenizer, lora, str(resolve_source(target_dir)))
    save_config(cfg, out_dir, {"trainer": KIND, "target": str(target_dir), "data": [str(f) for f in data_files], **hp,
                               "unit_size": m, "placeholder_id": placeholder})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def save_lud(peft_model, out_dir: Path, fp: dict, unit_size: int, placeholder: int, tokenizer, lora: dict, base: str) -> None:
    """The adapter as peft writes it (adapter_config.json, adapter_model.safetensors) and config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    write_json(out_dir / "config.json", {
        "specdec_kind": KIND,
        "unit_size": unit_size,
        "placeholder_id": placeholder,
        "placeholder_token": _token_text(tokenizer, placeholder),
        "lora": lora,
        "specdec_target": fp,
        "base_model": base,
        "adapter": "adapter_model.safetensors",
    })


def _token_text(tokenizer, token_id: int) -> str | None:
    try:
        return tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, KeyError, ValueError, TypeError, OverflowError):
        return None  # an id past the tokenizer's vocabulary (a model's padding rows)
