"""train-draft: distil a small causal LM from the target (forward KL + CE) through the shared loop.

The artifact is a normal Hugging Face causal LM directory (save_pretrained, safetensors, the
target's tokenizer) whose config.json also carries ``specdec_kind: draft`` and
``specdec_target`` (the target tokenizer's fingerprint), so ``--drafter DIR`` and
AutoModelForCausalLM both load it. ``--lora`` with ``lora_save="adapter"`` writes a peft adapter
instead of merged weights; ``models.loading.load_draft`` handles both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from specdec.train.teacher import TEACHER_CACHE_FORMAT, eval_batch, teacher_cache_key  # noqa: F401
from specdec.models.artifacts import SpecdecError, UsageError, check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.train.loop import TrainConfig, run_training, save_config

TAU_KS = tuple(range(1, 9))


# ---------------------------------------------------------------------------------------------
# Loading


def parse_arch(spec: str) -> dict:
    """``layers=2,hidden=128,heads=4[,kv_heads=2,ffn=256]`` -> LlamaConfig keyword arguments."""
    names = {
        "layers": "num_hidden_layers",
        "hidden": "hidden_size",
        "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads",
        "ffn": "intermediate_size",
        "intermediate": "intermediate_size",
    }
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in names:
            raise UsageError(f"bad --arch item {part!r}: use layers=N,hidden=N,heads=N[,kv_heads=N,ffn=N]")
        try:
            out[names[key.strip()]] = int(value)
        except ValueError:
            raise UsageError(f"bad --arch value {part!r}: an integer is needed") from None
    if "hidden_size" in out and "num_attention_heads" in out and out["hidden_size"] % out["num_attention_heads"]:
        raise UsageError("--arch: hidden must be a multiple of heads")
    return out


def new_vocab_draft(target, arch: str, vocab):
    """A fresh small Llama over the reduced vocabulary ``vocab`` (models.vocab), sized by ``arch``, its
    embedding (tied to its output layer) started from the target's embedding rows of those tokens
    projected on their top principal directions: the draft begins knowing which tokens are alike."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.arch import FULL, text_config

    kw = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4}
    kw.update(parse_arch(arch))
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw.setdefault("intermediate_size", kw["hidden_size"] * 3)
    tc = text_config(target.config)
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    rope = dict(rope.get(FULL, rope))
    rope.pop("partial_rotary_factor", None)
    t2d = vocab.t2d
    special = {k: int(t2d[v]) for k, v in (("bos_token_id", tc.bos_token_id), ("eos_token_id", tc.eos_token_id),
                                           ("pad_token_id", getattr(tc, "pad_token_id", None))) if isinstance(v, int)}
    config = LlamaConfig(vocab_size=vocab.size, max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
                         tie_word_embeddings=True, **({"rope_parameters": rope} if rope.get("rope_type") else {}), **special, **kw)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        rows = target.get_input_embeddings().weight.detach().float()[vocab.d2t.to(target.device)].cpu()
        rows = rows - rows.mean(0)
        _, _, v = torch.linalg.svd(rows, full_matrices=False)
        proj = rows @ v[: kw["hidden_size"]].T
        proj = torch.nn.functional.pad(proj, (0, kw["hidden_size"] - proj.shape[1]))  # fewer directions than its width
        proj = proj / proj.std() * model.config.initializer_range * 4
        model.get_input_embeddings().weight.copy_(proj)
    return model


def new_draft(target_config, arch: str):
    """A fresh small causal LM of the target's own architecture, sized by ``arch``: the target's rope
    settings, sliding window and layer-type mix, vocabulary and special tokens. Where that
    architecture cannot take these sizes (or has no causal-LM class), a Llama with the target's
    vocabulary, special tokens and rope parameters."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from specdec.models.arch import FULL, resized_config, text_config

    kw = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4}
    kw.update(parse_arch(arch))
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw.setdefault("intermediate_size", kw["hidden_size"] * 3)
    try:
        config = resized_config(target_config, **kw)
        config.tie_word_embeddings = False
        return AutoModelForCausalLM.from_config(config)
    except (SpecdecError, StrictDataclassError, ValueError, TypeError, KeyError, AttributeError):
        pass
    tc = text_config(target_config)
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    rope = dict(rope.get(FULL, rope))  # per-layer-type parameters (Gemma-3): the full layers'
    rope.pop("partial_rotary_factor", None)  # Llama rotates the whole head
    config = LlamaConfig(
        vocab_size=tc.vocab_size,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
        tie_word_embeddings=False,
        **({"rope_parameters": rope} if rope.get("rope_type") else {}),
        **kw,
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# Losses


def kd_loss(student_logits, input_ids, teacher, kd_weight: float, temperature: float, ce_labels: str = "data", labels=None):
    """kd_weight * T^2 * KL(p_T || q_T) + (1 - kd_weight) * CE.

    ``teacher`` is full logits [B, T, V] or a sparse (values [B, T, k], indices [B, T, k]) pair from
    the disk cache (the KL then runs over the teacher's top-k support, renormalised). The CE term's
    labels are the data's next tokens (``ce_labels="data"``) or the target's greedy choices
    (``"target"``): what a greedy round accepts, at the prompt's positions too.
    ``labels``: the data's tokens as indices into the student's vocabulary when it is not the input's
    (a reduced draft vocabulary; -100 outside it, ignored).
    Returns (loss, {"kl": ..., "ce": ...}).
    """
    import torch
    import torch.nn.functional as F

    s = student_logits.float()
    vocab, targets = s.shape[-1], (input_ids if labels is None else labels)[:, 1:].reshape(-1)
    if kd_weight <= 0:
        ce = F.cross_entropy(s[:, :-1].reshape(-1, vocab), targets, ignore_index=-100)
        return ce, {"ce": float(ce.detach())}
    t = temperature
    log_q = F.log_softmax(s if t == 1 else s / t, dim=-1)  # one pass over the vocabulary serves CE too when t == 1
    log_q1 = log_q if t == 1 else F.log_softmax(s, dim=-1)
    if ce_labels == "target":  # the target's greedy token at every position, the prompt's included
        greedy = teacher[1][..., 0] if isinstance(teacher, tuple) else teacher.argmax(-1)
        ce = F.nll_loss(log_q1.reshape(-1, vocab), greedy.reshape(-1).long())
    else:
        ce = F.nll_loss(log_q1[:, :-1].reshape(-1, vocab), targets, ignore_index=-100)
    if isinstance(teacher, tuple):
        values, indices = teacher
        log_p = F.log_softmax(values.float() / t, dim=-1)
        log_q = log_q.gather(-1, indices.long())
    else:
        log_p = F.log_softmax(teacher.float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean() * t * t
    loss = kd_weight * kl + (1 - kd_weight) * ce if kd_weight < 1 else kl
    return loss, {"kl": float(kl.detach()), "ce": float(ce.detach())}


def _read_teacher_cache(path: Path, key: dict) -> tuple[dict | None, dict, str]:
    """(tensors, metadata, why not) for the cache at ``path``: tensors is None when the file is
    missing, unreadable or made from other inputs, and ``why not`` says which."""
    from safetensors import safe_open

    if not path.exists():
        return None, {}, ""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            stored = json.loads(meta.get("specdec_teacher", "{}"))
            if stored != key:
                changed = sorted(k for k in key if stored.get(k) != key[k]) or ["format"]
                return None, meta, f"it was computed for other {', '.join(changed)}"
            cached = {k: f.get_tensor(k) for k in ("values", "indices")}
    except Exception as exc:  # a torn or foreign file: safetensors raises its own error types
        return None, {}, f"it is unreadable: {type(exc).__name__}: {exc}"
    want = (int(key["blocks"]), int(key["seq_len"]), int(key["top_k"]))
    if any(tuple(v.shape) != want for v in cached.values()):
        return None, meta, "its shapes do not match"
    return cached, meta, ""


def cache_teacher_logits(target, dataset, path: Path, top_k: int, batch: int = 8) -> tuple[dict, dict]:
    """Top-k teacher logits for every training block, on disk (safetensors), indexed by ``idx``.

    Reused only when its key (``teacher_cache_key``) matches; otherwise, or when the file is torn,
    it is recomputed and replaced atomically. Returns (tensors, metadata); the metadata's
    ``compute_s`` is how long the forwards took when the cache was made."""
    import torch
    from safetensors.torch import save_file

    key = teacher_cache_key(target, dataset, top_k)
    cached, meta, why = _read_teacher_cache(path, key)
    if cached is not None:
        return cached, meta
    if why:
        print(f"teacher cache {path}: {why}; recomputing", file=sys.stderr)
    start = time.perf_counter()
    values, indices = [], []
    with torch.no_grad():
        for i in range(0, len(dataset), batch):
            ids = dataset[i : i + batch]["input_ids"].to(target.get_input_embeddings().weight.device)
            logits = target(input_ids=ids).logits.float()
            v, ix = logits.topk(top_k, dim=-1)
            values.append(v.half())
            indices.append(ix.int())
    cached = {"values": torch.cat(values), "indices": torch.cat(indices)}
    meta = {"specdec_teacher": json.dumps(key, sort_keys=True), "compute_s": repr(time.perf_counter() - start)}
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a process killed while writing
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(cached, str(tmp), metadata=meta)
    # a reader sees the old file or the complete new one, never a torn one, even after a crash
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return cached, meta


# ---------------------------------------------------------------------------------------------
# Metrics


def chain_tau(match, ks=TAU_KS) -> dict:
    """Expected tokens per target forward (bonus counted) for chains of K drafts, teacher-forced.

    ``match`` [N, T] holds, per held-out position, whether the draft's next-token choice equals the
    target's (greedy) or the acceptance probability sum_x min(p, q) (sampling). A round starting at
    t accepts draft i with the product of the first i entries from t, so
    tau(K) = mean_t sum_{i=0..K} prod_{j<i} match[t + j]. Starts leave room for max(ks) drafts.
    Also returns alpha_i = P(position i accepted | positions < i accepted).
    """
    import torch

    kmax = max(ks)
    m = match.double()
    n, t = m.shape
    starts = t - kmax
    if starts <= 0:
        raise SpecdecError(f"held-out blocks are too short for K={kmax}")
    prods = [torch.ones(n, starts, dtype=torch.float64)]
    for j in range(kmax):
        prods.append(prods[-1] * m[:, j : j + starts])
    reach = torch.stack([p.mean() for p in prods])  # P(first i drafts accepted)
    tau = {str(k): float(reach[: k + 1].sum()) for k in ks}
    alpha = [float(reach[i + 1] / reach[i]) if reach[i] > 0 else 0.0 for i in range(kmax)]
    return {"tau": tau, "alpha": alpha}


def evaluate_draft(draft, target, heldout, batch: int = 8, temperature: float = 1.0) -> dict:
    """Held-out CE, top-1 agreement with the target, expected tau for K = 1..8 (greedy and T=1)."""
    import torch
    import torch.nn.functional as F

    ces, agree, greedy, sampled = [], [], [], []
    batch = eval_batch(batch, heldout, target)
    with torch.no_grad():
        for i in range(0, len(heldout), batch):
            ids = heldout[i : i + batch]["input_ids"].to(target.get_input_embeddings().weight.device)
            q = draft(input_ids=ids).logits.float()
            p = target(input_ids=ids).logits.float()
            ce = F.cross_entropy(q[:, :-1].reshape(-1, q.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
            ces.append(ce[ce.isfinite()])  # a reduced vocabulary's draft cannot say the others (-inf): left out
            m = q.argmax(-1) == p.argmax(-1)
            agree.append(m.float().flatten())
            greedy.append(m)
            pp, qq = F.softmax(p / temperature, -1), F.softmax(q / temperature, -1)
            sampled.append(torch.minimum(pp, qq).sum(-1))
    g = chain_tau(torch.cat(greedy))
    s = chain_tau(torch.cat(sampled))
    return {
        "heldout_ce": float(torch.cat(ces).mean()),
        "top1_agreement": float(torch.cat(agree).mean()),
        "expected_tau": g["tau"],
        "per_position_acceptance": g["alpha"],
        "expected_tau_sampled": s["tau"],
        "heldout_blocks": len(heldout),
        "tau_method": (
            "teacher-forced on held-out blocks: tau(K) = mean over start positions t of "
            "sum_{i=0..K} prod_{j<i} a[t+j], a = 1[argmax q == argmax p] (greedy) or sum_x min(p, q) "
            "(T=1); counts the bonus token"
        ),
    }


# ---------------------------------------------------------------------------------------------
# The trainer


def train_draft(
    target_dir: str | Path,
    data_files: list[str | Path],
    out_dir: str | Path,
    cfg: TrainConfig,
    init: str | Path | None = None,
    arch: str | None = None,
    kd_weight: float = 0.9,
    temperature: float = 1.0,
    lora: bool = False,
    lora_save: str = "merged",
    lora_rank: int = 8,
    cache_teacher: bool = False,
    teacher_topk: int = 64,
    ce_labels: str = "data",
    resume: bool = False,
    placement=None,
    draft_vocab: int | None = None,
    teacher_cache: str | Path | None = None,
    charge_teacher: bool = True,
) -> dict:
    """Train a draft and write its artifact; returns metrics (empty on non-main processes).
    ``placement`` (models.loading.Placement): how the frozen target loads."""
    import torch
    from transformers import AutoConfig

    from specdec.train.data import load_blocks, load_teacher, trainable_draft
    from specdec.train.loop import make_accelerator

    out_dir = Path(out_dir)
    if init and arch:
        raise UsageError("give --init or --arch, not both")
    if lora and not init:
        raise UsageError("--lora trains an adapter on an initialized draft: give --init DIR")
    if lora_save not in ("merged", "adapter"):
        raise UsageError("lora_save must be merged or adapter")
    if not 0.0 <= kd_weight <= 1.0 or temperature <= 0:
        raise UsageError("kd_weight must lie in [0, 1] and temperature be > 0")
    if ce_labels not in ("data", "target"):
        raise UsageError("ce_labels must be data or target")
    if draft_vocab and (init or lora):
        raise UsageError("--draft-vocab builds a new draft over the reduced vocabulary: it does not combine with --init or --lora")
    accelerator = make_accelerator(cfg)
    target, tokenizer = load_teacher(target_dir, placement, accelerator)
    fp = tokenizer_fingerprint(tokenizer)
    if init:
        init_cfg = read_config(init)
        if "specdec_target" in init_cfg:
            check_fingerprint(init_cfg["specdec_target"], fp, f"--init {init}")
        if AutoConfig.from_pretrained(init).vocab_size != target.config.vocab_size:
            raise SpecdecError(f"--init {init} has another vocabulary size than the target")
        draft = trainable_draft(init, placement)
    train, held = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    vocab = None
    if draft_vocab:
        from specdec.train.teacher import training_vocab

        vocab = training_vocab(train, tokenizer, draft_vocab, target.config.vocab_size)
        torch.manual_seed(cfg.seed)
        draft = new_vocab_draft(target, arch or "", vocab)
        cache_teacher = True  # the teacher's logits over the draft's tokens only: a cheap forward, computed once
    elif not init:
        torch.manual_seed(cfg.seed)
        draft = new_draft(target.config, arch or "")
    if lora:
        from peft import LoraConfig, get_peft_model

        from specdec.models.arch import attention_projections

        # every attention projection, by this architecture's names; none found: peft's default for the model type
        targets = attention_projections(draft) or None
        draft = get_peft_model(
            draft,
            LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=targets),
        )

    cached, cache_s = None, 0.0
    if vocab is not None and kd_weight > 0:
        from specdec.train import teacher

        path = Path(teacher_cache) if teacher_cache else out_dir / "teacher_cache.safetensors"
        start = time.perf_counter()
        if accelerator.is_main_process:
            teacher.build(target, train, path, [], vocab, min(teacher_topk, vocab.size - 1),
                          console=lambda m: print(m, file=sys.stderr, flush=True))
        accelerator.wait_for_everyone()
        got = teacher.build(target, train, path, [], vocab, min(teacher_topk, vocab.size - 1))
        cached = {"values": got["values"].to(accelerator.device), "indices": got["indices"].long().to(accelerator.device)}
        cache_s = time.perf_counter() - start
        if charge_teacher and cfg.budget_minutes > 0:
            cfg = dataclasses.replace(cfg, budget_minutes=max(cfg.budget_minutes - teacher.compute_seconds(path) / 60, 0.01))
    elif cache_teacher and kd_weight > 0:
        path = out_dir / "teacher_cache.safetensors"
        start = time.perf_counter()
        if accelerator.is_main_process:
            cache_teacher_logits(target, train, path, min(teacher_topk, target.config.vocab_size))
        accelerator.wait_for_everyone()
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            compute_s = float(f.metadata()["compute_s"])
            cached = {k: f.get_tensor(k).to(accelerator.device) for k in ("values", "indices")}
        cached["indices"] = cached["indices"].long()  # gather's index type, converted once
        cache_s = time.perf_counter() - start
        # the teacher's forwards are training time: a run compares at equal minutes. They are charged
        # as recorded when the cache was made, so a resumed run or one reusing the cache gets the same
        # budget as the run that computed it, and every process the same number
        if cfg.budget_minutes > 0:
            cfg = dataclasses.replace(cfg, budget_minutes=max(cfg.budget_minutes - compute_s / 60, 0.01))

    t2d = None if vocab is None else vocab.t2d.to(accelerator.device)
    labels_map = None
    if vocab is not None:
        labels_map = torch.where(t2d == vocab.size - 1, -100, t2d)  # no label outside the draft vocabulary

    def loss_fn(model, batch):
        ids = batch["input_ids"]
        if t2d is not None:
            logits = model(input_ids=t2d[ids]).logits
            teacher_top = (cached["values"][batch["idx"]], cached["indices"][batch["idx"]]) if cached is not None else None
            return kd_loss(logits, ids, teacher_top, kd_weight if teacher_top is not None else 0.0, temperature, ce_labels,
                           labels=labels_map[ids])
        logits = model(input_ids=ids).logits
        if kd_weight <= 0:
            teacher = None
        elif cached is not None:
            teacher = (cached["values"][batch["idx"]], cached["indices"][batch["idx"]])
        else:
            with torch.no_grad():
                teacher = target(input_ids=ids).logits
        return kd_loss(logits, ids, teacher, kd_weight, temperature, ce_labels)

    result = run_training(cfg, draft, loss_fn, train, out_dir, resume=resume, accelerator=accelerator)
    if not result.is_main:
        return {}
    model = result.model
    evaluated = model
    if vocab is not None:
        from specdec.models.vocab import MappedVocabLM

        evaluated = MappedVocabLM(model, vocab)
    metrics = evaluate_draft(evaluated, target, held, batch=cfg.batch, temperature=temperature)
    metrics.update(
        kind="draft", kd_weight=kd_weight, temperature=temperature, steps=result.steps, stopped=result.stopped,
        train_wall_s=round(result.wall_s, 3), loss_curve=result.losses, final_loss=result.losses[-1] if result.losses else None,
        processes=accelerator.num_processes, teacher="cached-top%d" % teacher_topk if cached is not None else "on-the-fly",
        teacher_cache_s=round(cache_s, 3), ce_labels=ce_labels if kd_weight > 0 else "data",
        train_tokens=result.steps * cfg.batch * cfg.grad_accum * cfg.seq_len * accelerator.num_processes,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    if vocab is not None:
        from specdec.train.teacher import heldout_coverage

        metrics.update(draft_vocab=vocab.size, vocab_coverage_heldout=heldout_coverage(vocab, held))
    _save_draft(model, tokenizer, out_dir, fp, lora, lora_save, init, vocab)
    save_config(cfg, out_dir, {"trainer": "draft", "target": str(target_dir), "data": [str(f) for f in data_files],
                               "init": str(init) if init else None, "arch": arch, "kd_weight": kd_weight,
                               "temperature": temperature, "lora": lora, "lora_save": lora_save,
                               "cache_teacher": cache_teacher, "ce_labels": ce_labels})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def _save_draft(model, tokenizer, out_dir: Path, fp: dict, lora: bool, lora_save: str, init, vocab=None) -> None:
    if lora and lora_save == "merged":
        model = model.merge_and_unload()
    if lora and lora_save == "adapter":
        model.save_pretrained(out_dir)  # adapter_config.json + adapter_model.safetensors
        config = model.get_base_model().config.to_dict()
        config["specdec_adapter_base"] = str(Path(init).resolve())
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
        config = json.loads((out_dir / "config.json").read_text())
    tokenizer.save_pretrained(out_dir)
    config["specdec_kind"] = "draft"
    config["specdec_target"] = fp
    if vocab is not None:  # a draft over a reduced vocabulary: its ids map to the target's (models.vocab)
        vocab.save(out_dir)
        config["specdec_draft_vocab"] = vocab.size
    write_json(out_dir / "config.json", config)
