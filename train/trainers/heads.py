"""train-heads: Medusa, Clover, EAGLE and Chimera drafting heads on a frozen target, through the shared loop;
export to the methods' public checkpoint layouts."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from specdec.models.artifacts import load_weights, read_config, tokenizer_fingerprint, write_json
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.heads import RIDE_KINDS
from specdec.models.head_artifacts import build_heads, save_heads
from specdec.train.loop import TrainConfig, run_training, save_config
from specdec.train.settings import HeadSettings
from specdec.train.teacher import heldout_coverage, resolve_draft_vocab, training_vocab

def evaluate_heads(heads, target, heldout, k: int, batch: int = 8, top_k: int = 5) -> dict:
    """Per-head top-1/top-k accuracy (against the data and the target's greedy choice) and tau."""

    # counted where the target's forwards run (a GPU's counts stay there until the end)
    device = target.get_input_embeddings().weight.device
    hits1, hitsk, agree, count = (torch.zeros(k, device=device) for _ in range(4))
    matches = []
    from specdec.train.teacher import eval_batch

    batch = eval_batch(batch, heldout, target, budget_bytes=1e9 / max(k, 1))
    # the heads read the target's states in their own dtype (a bf16 target beside float32 heads, outside
    # the training loop's autocast)
    dtype = next(heads.parameters()).dtype
    with torch.no_grad():
        for i in range(0, len(heldout), batch):
            ids = heldout[i : i + batch]["input_ids"].to(device)
            out = target(input_ids=ids, output_hidden_states=True)
            greedy = out.logits.argmax(-1)
            logits = heads.chain_logits(tuple(h.to(dtype) for h in out.hidden_states), ids, k).float()
            t = ids.shape[1]
            m = torch.zeros(ids.shape[0], t - 1 - k, k, dtype=torch.bool, device=device)
            for j in range(k):
                n = t - 2 - j
                top = heads.to_target(logits[j, :, :n].topk(top_k, -1).indices)
                data = ids[:, 2 + j :]
                hits1[j] += (top[..., 0] == data).sum()
                hitsk[j] += (top == data[..., None]).any(-1).sum()
                agree[j] += (top[..., 0] == greedy[:, 1 + j : 1 + j + n]).sum()
                count[j] += data.numel()
                m[:, :, j] = (top[..., 0] == greedy[:, 1 + j : 1 + j + n])[:, : t - 1 - k]
            matches.append(m)
    # a round from position t accepts head j's token while heads 0..j all agree with the target
    m = torch.cat(matches)  # [N, S, k]
    reach = [torch.ones(m.shape[:2], dtype=torch.float64, device=m.device)]
    for j in range(k):
        reach.append(reach[-1] * m[..., j].double())
    reach_mean = [float(r.mean()) for r in reach]
    tau = {str(j): sum(reach_mean[: j + 1]) for j in range(1, k + 1)}
    return {
        "top1_accuracy": (hits1 / count).tolist(),
        f"top{top_k}_accuracy": (hitsk / count).tolist(),
        "top1_agreement_with_target": (agree / count).tolist(),
        "expected_tau": tau,
        "tau_method": "teacher-forced on held-out blocks, top-1 chain: tau(K) = mean_t sum_{i=0..K} prod_{j<i} "
                      "1[head j's top-1 at t == target argmax at t+1+j]; counts the bonus token; a tree only adds to it",
        "heldout_blocks": len(heldout),
    }


def mask_token(tokenizer, embedding: torch.Tensor, given: int | None = None) -> int:
    """The token whose embedding fills a published block drafter's drafting slots (DFlash's mask token): the
    tokenizer's own mask token, else its unk, pad, BOS or EOS token (in that order: those least part of a text's
    middle), the first whose row of ``embedding`` is not zero: a zero row (a padding index's) would give every drafting
    slot a zero query, so attention the same weight on every key whatever it learns. ``given``: checked, not chosen."""
    if given is not None:
        if not 0 <= given < embedding.shape[0] or not bool(embedding[given].any()):
            raise UsageError(f"--mask-token-id {given}: " + ("outside the target's vocabulary" if not 0 <= given < embedding.shape[0]
                             else "its embedding is zero, so every drafting slot's query would be zero"))
        return given
    for name in ("mask_token_id", "unk_token_id", "pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None and 0 <= int(value) < embedding.shape[0] and bool(embedding[int(value)].any()):
            return int(value)
    raise UsageError("the tokenizer has no mask, unk, pad, BOS or EOS token with a non-zero embedding for the block drafter's "
                     "drafting slots: give --mask-token-id")


def train_heads(kind: str, target_dir: str | Path, data_files: list[str | Path], out_dir: str | Path, cfg: TrainConfig,
                settings: HeadSettings | None = None, *, resume: bool = False, placement=None, **changes) -> dict:
    """Train one head kind on the frozen target; writes the artifact, returns metrics. ``settings``
    (``HeadSettings``, with ``changes`` by name on top, a None among them not given): what it trains,
    checked for ``kind`` before anything loads; ``placement`` (models.loading.Placement): how the target
    loads. ``draft_vocab`` N: the heads propose only the N - 1 most frequent tokens of the training blocks
    (``models.vocab``; the target's output layer is read at their rows only). ``teacher_cache``: the
    target's features and top-k logits over the training blocks are computed once into this file
    (``train.teacher``; its forward time is charged to the budget) instead of a target forward every step;
    with ``draft_vocab`` it is always used."""
    from specdec.train import teacher
    from specdec.train.data import load_blocks, load_teacher
    from specdec.train.loop import make_accelerator

    s = dataclasses.replace(settings or HeadSettings(), **{k: v for k, v in changes.items() if v is not None})
    s.check(kind)
    hp = s.hparams(kind)
    if hp.get("mask_token_id") is not None and hp.get("layout") != "published":
        raise UsageError("--mask-token-id fills the drafting slots of the published (DFlash) block layout; specdec's "
                         "layout learns its own mask embedding")
    if kind in RIDE_KINDS:  # PPD, Hidden Transfer: trained through the target's own forward
        return _train_riding(kind, target_dir, data_files, out_dir, cfg, resume, placement, hp)
    out_dir = Path(out_dir)
    accelerator = make_accelerator(cfg)
    target, tokenizer = load_teacher(target_dir, placement, accelerator)
    fp = tokenizer_fingerprint(tokenizer)
    if kind == "block" and hp.get("layout") == "published":
        hp["mask_token_id"] = mask_token(tokenizer, target.get_input_embeddings().weight.detach(), hp.get("mask_token_id"))
    train, held = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    torch.manual_seed(cfg.seed)
    draft_vocab = resolve_draft_vocab(s.draft_vocab, target.config.vocab_size)
    if draft_vocab and kind == "medusa":
        hp.setdefault("shared_head", True)  # a head's own output layer would have the target's vocabulary
    vocab = training_vocab(train, tokenizer, draft_vocab, target.config.vocab_size) if draft_vocab else None
    published = kind == "eagle" and bool(hp.get("layout"))
    if vocab is not None and published:  # the published EAGLE-3 trains its own output layer over the draft's tokens
        hp["draft_ids"] = vocab.d2t[:-1]
    heads = build_heads(kind, target, hp).attach(target, init_from_lm_head=s.init_from_lm_head)
    hp.pop("draft_ids", None)
    if s.fspad:
        heads.enable_fspad(s.fspad_align)
    if vocab is not None and not published:
        heads.set_vocab(vocab)
    cache = None
    if draft_vocab or s.teacher_cache:
        path = Path(s.teacher_cache) if s.teacher_cache else out_dir / "teacher_cache.safetensors"
        layers = [*(getattr(heads, "feature_layers", None) or []), -1]
        started = time.time()
        if accelerator.is_main_process:
            teacher.build(target, train, path, layers, vocab, s.teacher_topk, console=lambda m: print(m, file=sys.stderr, flush=True))
        accelerator.wait_for_everyone()
        cache = teacher.build(target, train, path, layers, vocab, s.teacher_topk)
        # charged only when this run wrote the cache: one another run computed (a recipe's drafters share one) cost it nothing
        if s.charge_teacher and path.stat().st_mtime >= started and cfg.budget_minutes > 0:  # the teacher's forwards are training time: runs compare at equal minutes
            cfg = dataclasses.replace(cfg, budget_minutes=max(cfg.budget_minutes - teacher.compute_seconds(path) / 60, 0.01))

    def loss_fn(model, batch):
        ids = batch["input_ids"]
        if cache is not None:
            idx = batch["idx"].cpu()
            layers = teacher.batch_layers(cache, idx)
            layers = teacher.HiddenLayers({k: v.to(ids.device) for k, v in layers.layers.items()}, layers.count)
            top = (cache["values"][idx].to(ids.device), cache["indices"][idx].to(ids.device))
            return model(layers, ids, top)
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
        # float32 features: a bf16 target on a GPU feeds heads whose weights train in float32
        return model(tuple(h.float() for h in out.hidden_states), ids, out.logits.float())

    result = run_training(cfg, heads, loss_fn, train, out_dir, resume=resume, accelerator=accelerator)
    if not result.is_main:
        return {}
    heads = result.model.float().attach(target)
    if vocab is not None and not published:
        heads.set_vocab(vocab)
    k = heads.num_heads if kind != "eagle" else s.eval_depth
    metrics = evaluate_heads(heads, target, held, min(k, cfg.seq_len - 3), batch=cfg.batch)
    metrics.update(kind=kind, steps=result.steps, stopped=result.stopped, train_wall_s=round(result.wall_s, 3),
                   loss_curve=result.losses, final_loss=result.losses[-1] if result.losses else None,
                   train_tokens=result.steps * cfg.batch * cfg.grad_accum * cfg.seq_len * accelerator.num_processes)
    if vocab is not None:
        metrics.update(draft_vocab=vocab.size, vocab_coverage_heldout=heldout_coverage(vocab, held))
    if cache is not None:
        metrics["teacher_s"] = round(teacher.compute_seconds(path), 1)
    save_heads(heads, out_dir, fp, target.config)
    save_config(cfg, out_dir, {"trainer": "heads", "kind": kind, "target": str(target_dir), "data": [str(f) for f in data_files],
                               "draft_vocab": draft_vocab, "teacher_topk": s.teacher_topk if cache is not None else None, **hp})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def _train_riding(kind: str, target_dir, data_files, out_dir, cfg: TrainConfig, resume: bool, placement, hp: dict) -> dict:
    """PPD prompt embeddings or Hidden Transfer maps (``models.heads.PromptTokens`` / ``TransferMaps``) on the frozen
    target: each training block gets ``cuts`` cut points (extra ``cuts``, default 16), each followed by m
    placeholder positions (extra ``num_heads``, default 3) that see the block up to the cut; one forward per block
    covers every cut (``train.trainers.lud.pack``, the packing of Lexical Unit Decoding, unit size m + 1). Placeholder j
    after the cut's last real token x_t learns x_{t+2+j} (x_{t+1} is the target's own next token), the module's
    inputs injected by hooks on the target as at decode (``decode.drafters.parallel_prompts``)."""
    from specdec.train.data import block_prefix, load_blocks, load_teacher
    from specdec.train.loop import make_accelerator
    from specdec.train.trainers.lud import LudCollate, MaskMaker, choose_placeholder

    out_dir = Path(out_dir)
    accelerator = make_accelerator(cfg)
    target, tokenizer = load_teacher(target_dir, placement, accelerator)
    target.requires_grad_(False)  # gradients flow through it to the injected inputs only
    fp = tokenizer_fingerprint(tokenizer)
    m = hp["num_heads"] = int(hp.get("num_heads") or 3)
    skip = len(block_prefix(tokenizer))
    if cfg.seq_len < skip + m + 2:
        raise UsageError(f"--kind {kind} needs --seq-len >= num_heads + 2 + the {skip}-token prefix every block starts "
                         f"with (got {cfg.seq_len} for {m} heads)")
    vocab = target.get_input_embeddings().weight.shape[0]
    if hp.get("placeholder") is None:
        try:
            hp["placeholder"] = choose_placeholder(tokenizer, vocab)
        except SpecdecError:  # its input is replaced (PPD) or only its own positions read it (Hidden Transfer): any id serves
            hp["placeholder"] = 0
    train, held = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    torch.manual_seed(cfg.seed)
    heads = build_heads(kind, target, hp).attach(target, init_from_lm_head=True)
    masks = MaskMaker(target.config, target.dtype)
    collate = LudCollate(cfg.seed, m + 1, int(hp.get("cuts") or 16), int(hp["placeholder"]), skip=skip,
                         copies=heads.ensemble)

    def loss_fn(model, batch):
        return model(target, batch, masks)

    result = run_training(cfg, heads, loss_fn, train, out_dir, resume=resume, accelerator=accelerator, collate_fn=collate, label=kind)
    if not result.is_main:
        return {}
    heads = result.model.float().attach(target)
    metrics = evaluate_riding(heads, target, held, collate, masks)
    metrics.update(kind=kind, num_heads=m, placeholder=int(hp["placeholder"]), steps=result.steps, stopped=result.stopped,
                   train_wall_s=round(result.wall_s, 3), loss_curve=result.losses,
                   final_loss=result.losses[-1] if result.losses else None,
                   train_tokens=result.steps * cfg.batch * cfg.grad_accum * cfg.seq_len * accelerator.num_processes)
    if kind == "hidden-transfer":
        metrics["layer"] = heads.layer
    save_heads(heads, out_dir, fp, target.config)
    save_config(cfg, out_dir, {"trainer": "heads", "kind": kind, "target": str(target_dir), "data": [str(f) for f in data_files], **hp})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def evaluate_riding(heads, target, heldout, collate, masks, blocks: int = 32, batch: int = 8) -> dict:
    """Held-out top-1 accuracy and CE of each riding position against the data (cut points drawn with a fixed seed)."""
    m = heads.num_heads
    hits, ce, count = torch.zeros(m), torch.zeros(m), 0
    gen = torch.Generator().manual_seed(0)
    device = target.get_input_embeddings().weight.device
    n = min(len(heldout), blocks)
    with torch.no_grad():
        for i in range(0, n, batch):
            packed = {k: v.to(device) for k, v in collate.make(heldout[i : min(i + batch, n)]["input_ids"], gen).items()}
            logits, labels = heads.packed_logits(target, packed, masks)
            bsz = labels.shape[0]
            hits += (logits.argmax(-1) == labels).view(bsz, -1, m).sum((0, 1)).float().cpu()
            ce += torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                    reduction="none").view(bsz, -1, m).sum((0, 1)).cpu()
            count += labels.numel() // m
    count = max(count, 1)
    return {"top1_accuracy": (hits / count).tolist(), "heldout_ce": (ce / count).tolist(), "heldout_blocks": n}


# ---------------------------------------------------------------------------------------------
# Export


def export_artifact(src: Path, dst: Path, to: str, target: Path | None = None) -> Path:
    """Write a head artifact in the public checkpoint conventions.

    medusa --to hf: the Medusa repo layout (config.json with medusa_num_heads/medusa_num_layers,
      medusa_lm_head.safetensors with keys ``{head}.{layer}.linear.{weight,bias}`` and ``{head}.{L}.weight``).
    medusa --to vllm: vLLM's MedusaModel layout (``blocks.{head}.layers.{layer}.{weight,bias}``,
      ``lm_heads.{head}.weight``; config num_heads / num_hidden_layers, medusa_fc_bias so vLLM reads the biases).
    eagle --to speculators|eagle: heads trained with ``--layout published`` in the speculators eagle3 format, or
      EAGLE-1 / EAGLE-3 (SpecForge) layouts: models/interop.py.
    eagle --to hf|vllm: the EAGLE-1 layout (``fc.*``, ``layers.0.*`` of one Llama decoder layer, a
      Llama config with num_hidden_layers 1); multi-layer (EAGLE-3) artifacts add ``fuse.weight``.
    eagle --to gguf: a published EAGLE-3 head as one GGUF file of llama.cpp's ``eagle3`` architecture,
      the tokenizer copied from the target's GGUF file ``target`` (default: the one it was trained on):
      models/gguf_export.py.
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    block = read_config(src)
    if block.get("kind") == "block":
        if block.get("layout") != "published":
            raise UsageError(f"{src} is a block drafter of specdec's layout, which no published loader runs: DFlash's (vLLM, "
                             "SGLang, speculators, llama.cpp's draft-dflash) queries read token embeddings alone and its context "
                             "keys no layer norm, where this drafter fuses the last context entry into every query and adds "
                             "block-position vectors; train it with `--layout published` (the default) to export it")
        if to != "speculators":
            raise UsageError(f"{src} is a block drafter of DFlash's layout: export it --to speculators (speculators' dflash "
                             f"checkpoint, which vLLM loads), not --to {to}")
        from specdec.models import interop

        return interop.export_dflash(src, dst)
    if to == "gguf":
        from specdec.models.gguf_export import export_gguf

        return export_gguf(src, dst, target)
    if target is not None:
        raise UsageError(f"--target applies to --to gguf (the target's GGUF file), not --to {to}")
    if to in ("speculators", "eagle"):  # published EAGLE layouts (models/interop.py)
        from specdec.models import interop

        return interop.export_speculators(src, dst) if to == "speculators" else interop.export_eagle(src, dst)
    if to not in ("hf", "vllm"):
        raise UsageError(f"--to must be hf, vllm, speculators, eagle or gguf, not {to!r}")
    cfg = read_config(src)
    kind = cfg.get("kind")
    if cfg.get("layout"):
        raise UsageError(f"{src} is an EAGLE head of the published architecture: export it --to speculators or --to eagle")
    weights = load_weights(src)
    dst.mkdir(parents=True, exist_ok=True)
    if kind == "medusa":
        n, layers = int(cfg["num_heads"]), int(cfg["num_layers"])
        out = {}
        for i in range(n):
            for j in range(layers):
                for p in ("weight", "bias"):
                    w = weights[f"heads.{i}.{j}.linear.{p}"]
                    out[f"{i}.{j}.linear.{p}" if to == "hf" else f"blocks.{i}.layers.{j}.{p}"] = w
            out[f"{i}.{layers}.weight" if to == "hf" else f"lm_heads.{i}.weight"] = weights[f"heads.{i}.{layers}.weight"]
        if to == "hf":
            save_file(out, str(dst / "medusa_lm_head.safetensors"))
            conf = {"medusa_num_heads": n, "medusa_num_layers": layers, "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"]}
        else:
            save_file(out, str(dst / "model.safetensors"))
            conf = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": n, "num_hidden_layers": layers, "medusa_fc_bias": True,
                    "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"], "truncated_vocab_size": cfg["vocab_size"]}
    elif kind == "eagle":
        if cfg.get("fspad"):  # the EAGLE-1 layout has no place for the sampler: an export without it would draft differently
            raise UsageError(f"{src} is an FSPAD head (feature sampler after fc): the EAGLE-1 --to {to} layout cannot express it")
        out = {}
        for k, v in weights.items():
            if k.startswith("decoder.layers."):
                out["layers." + k[len("decoder.layers.") :]] = v
            elif k.startswith(("fc.", "fuse.")):
                out[k] = v
        save_file(out, str(dst / "model.safetensors"))
        conf = {"architectures": ["EagleLlamaForCausalLM" if to == "vllm" else "LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": 1, "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"], "bias": True,
                "eagle_feature_layers": cfg.get("feature_layers")}
    else:
        raise SpecdecError(f"export supports medusa and eagle artifacts; {src} is kind {kind!r} (no public convention)")
    conf["specdec_target"] = cfg.get("target")
    write_json(dst / "config.json", conf)
    return dst
