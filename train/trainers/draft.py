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
from dataclasses import dataclass
from pathlib import Path

from specdec.train.settings import DraftSettings
from specdec.models.artifacts import SpecdecError, UsageError, check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.train.loop import StepSeeded, TrainConfig, run_training, save_config

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

    from specdec.train.teacher import teacher_cache_key

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
    prods = [torch.ones(n, starts, dtype=torch.float64, device=m.device)]
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

    from specdec.train.teacher import eval_batch

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
# S2D: one sorted draft for several targets

def assign_depths(sizes: list[int], layers: int, given: list[int] | None = None) -> list[int]:
    """Each target's sub-model depth: ``given`` (one per target, in order, each 1..layers), else by size:
    the targets ranked by parameter count (ties: as given), the r-th smallest of n gets
    ceil(layers * (r + 1) / n) layers, so the largest gets the whole draft."""
    import math

    if given is not None:
        if len(given) != len(sizes):
            raise UsageError(f"--s2d-depths gives {len(given)} depths for {len(sizes)} targets")
        bad = [d for d in given if not 1 <= d <= layers]
        if bad:
            raise UsageError(f"--s2d-depths: depth {bad[0]} is not between 1 and the draft's {layers} layers")
        if max(given) != layers:
            raise UsageError(f"--s2d-depths: the deepest must be the draft's {layers} layers (the layers above "
                             f"{max(given)} would serve no target)")
        return list(given)
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    depths = [layers] * len(sizes)
    for rank, i in enumerate(order):
        depths[i] = max(1, math.ceil(layers * (rank + 1) / len(sizes)))
    return depths


class DepthTaps:
    """The logits of a causal LM's depth-n sub-models (its first n decoder layers, then its final norm and
    output layer), from one forward of the whole model: forward hooks keep the outputs of the layers asked
    for, and ``logits(n)`` runs the final norm and the output layer on layer n's. What the sub-model
    computes alone (``layer_skip_view`` of the top layers): a decoder layer only sees the layers below."""

    _NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm")

    def __init__(self, model, depths):
        import torch

        from specdec.models.arch import decoder_layers, text_config

        parent, _, layers = decoder_layers(model)
        self.layers = len(layers)
        self.norm = next((getattr(parent, n) for n in self._NORMS if isinstance(getattr(parent, n, None), torch.nn.Module)), None)
        if self.norm is None:
            raise SpecdecError(f"S2D: no final norm found beside the decoder layers of this {type(model).__name__}")
        self.head = model.get_output_embeddings()
        self.softcap = getattr(text_config(model.config), "final_logit_softcapping", None)
        self.out: dict[int, object] = {}
        self.handles = [layers[d - 1].register_forward_hook(self._keeper(d)) for d in sorted(set(depths)) if d < self.layers]

    def _keeper(self, depth: int):
        def keep(module, args, output):
            self.out[depth] = output[0] if isinstance(output, tuple) else output

        return keep

    def logits(self, depth: int, full=None):
        """Depth ``depth``'s logits of the last forward (``full``: the whole model's, for the full depth)."""
        import torch

        if depth >= self.layers:
            return full
        logits = self.head(self.norm(self.out[depth]))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.out = [], {}


# ---------------------------------------------------------------------------------------------
# LongSpec: a constant-cache draft trained at anchor-offset positions


def anchor_positions(rows: int, seq_len: int, sinks: int, max_positions: int, generator) -> "torch.Tensor":
    """Anchor-offset position ids [rows, seq_len] for training blocks: a block's first ``sinks`` tokens keep
    positions 0..sinks-1 (the attention sinks a long text starts with); the rest of row r continue from an
    anchor a_r drawn uniformly from [seq_len, max_positions - (seq_len - sinks)]: positions a_r,
    a_r + 1, ..., a_r + seq_len - sinks - 1. So every non-sink token sits beyond the block's own length,
    up to the model's last position, while the distances inside the window stay the text's own: short
    blocks train the positions a long context reaches. Where the model has no room for that
    (max_positions < 2 seq_len - sinks) the positions stay 0..seq_len-1."""
    import torch

    sinks = min(sinks, seq_len)
    base = torch.arange(seq_len, dtype=torch.long).expand(rows, -1).clone()
    high = max_positions - (seq_len - sinks)
    if high < seq_len or sinks >= seq_len:
        return base
    anchors = torch.randint(seq_len, high + 1, (rows, 1), generator=generator)
    base[:, sinks:] = anchors + torch.arange(seq_len - sinks, dtype=torch.long)[None]
    return base


def sink_window_visible(seq_len: int, sinks: int, window: int) -> "torch.Tensor":
    """[seq_len, seq_len] bool: a query sees the keys at or before it that are sinks (the block's first
    ``sinks`` tokens) or at most ``window`` tokens back, what the drafter's cache holds at decode
    (``decode.drafters.long_draft``: the sinks and the last ``window`` tokens, plus the token itself)."""
    import torch

    q = torch.arange(seq_len)[:, None]
    k = torch.arange(seq_len)[None]
    return (k <= q) & ((k < sinks) | (q - k <= window))


class AnchorCollate(StepSeeded):
    """Stacks a micro-batch's blocks and draws its anchor-offset ``position_ids`` (``anchor_positions``), a
    function of the seed and of the micro-batch's index (a ``StepSeeded``: a resumed run draws the same)."""

    def __init__(self, seed: int, sinks: int, max_positions: int):
        super().__init__(seed)
        self.sinks, self.max_positions = sinks, max_positions

    def __call__(self, items) -> dict:
        import torch

        _, gen = self.draw()
        ids = torch.stack([torch.as_tensor(it["input_ids"]) for it in items])
        idx = torch.tensor([int(it["idx"]) for it in items])
        return {"input_ids": ids, "idx": idx,
                "position_ids": anchor_positions(ids.shape[0], ids.shape[1], self.sinks, self.max_positions, gen)}


# ---------------------------------------------------------------------------------------------
# The trainer


def train_draft(target_dir, data_files: list[str | Path], out_dir: str | Path, cfg: TrainConfig,
                settings: DraftSettings | None = None, *, resume: bool = False, placement=None, **changes) -> dict:
    """Train a draft and write its artifact; returns metrics (empty on non-main processes).
    ``settings`` (``DraftSettings``, with ``changes`` by name on top): what it trains; ``placement``
    (models.loading.Placement): how the frozen target loads.

    The steps: the settings checked (``DraftSettings.check``), the teachers loaded (``_load_teachers``),
    the student built (``_student``), the teacher's outputs cached where asked (``_teacher_outputs``), the
    loss assembled (``_draft_loss``), the shared loop run, and the artifact evaluated and written
    (``_finish``).

    S2D (sorted speculative decoding): ``target_dir`` a list of several targets sharing one tokenizer (their
    fingerprints and vocabulary sizes must match). The draft (the first target's architecture, sized by
    ``arch``) serves target i with its depth-d_i sub-model: its first d_i decoder layers, then its final
    norm and output layer (``assign_depths``: ``s2d_depths``, else by the targets' sizes, the largest
    getting the whole draft). Every step distils each target's depth from that target (the KD loss of each
    pair, averaged over the targets; one forward of the draft gives every depth, ``DepthTaps``): the
    depths assigned to some target train, depths no target was assigned get no loss of their own (a
    prefix depth shares its layers with every deeper one). config.json's ``specdec_s2d`` records
    ``depths`` (target name -> depth) and ``targets`` (name, source, ``target_identity``, depth), which
    decoding matches the loaded target against (``decode.drafters.draft_model.s2d_depth``).
    metrics.json holds each target's held-out metrics at its depth and its loss curve (``s2d``).

    LongSpec (``long_context``): the draft attends to ``sinks`` sink tokens and the last ``window`` tokens
    (``sink_window_visible``; a block no longer than sinks + window + 1 needs no mask) and trains at
    anchor-offset positions (``anchor_positions``, drawn per micro-batch by ``AnchorCollate``) while the
    teacher sees the block at its own positions; config.json's ``specdec_long`` records ``window`` and
    ``sinks``, and decoding keeps the draft's cache at that size (``decode.drafters.long_draft``)."""
    from specdec.train.data import load_blocks
    from specdec.train.loop import make_accelerator

    s = dataclasses.replace(settings or DraftSettings(), **changes)
    if s.s2d_depths is not None:
        s = dataclasses.replace(s, s2d_depths=tuple(s.s2d_depths))
    out_dir = Path(out_dir)
    target_dirs = list(target_dir) if isinstance(target_dir, (list, tuple)) else [target_dir]
    s.check(len(target_dirs))
    accelerator = make_accelerator(cfg)
    teachers, tokenizer, fp = _load_teachers(target_dirs, placement, accelerator)
    train, held = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    draft, vocab = _student(s, teachers[0], tokenizer, fp, train, placement, cfg.seed, len(target_dirs))
    teacher, cfg = _teacher_outputs(s, teachers, train, vocab, out_dir, cfg, accelerator)
    loss = _draft_loss(s, draft, teachers, vocab, teacher, cfg, accelerator, target_dirs)
    try:
        result = run_training(cfg, draft, loss, train, out_dir, resume=resume, accelerator=accelerator, collate_fn=loss.collate)
    finally:
        if loss.taps is not None:
            loss.taps.close()
    if not result.is_main:
        return {}
    return _finish(s, result, teachers, tokenizer, fp, vocab, held, teacher, loss, cfg, accelerator, target_dirs, data_files, out_dir)


def _load_teachers(target_dirs: list, placement, accelerator) -> tuple[list, object, dict]:
    """The frozen targets (S2D: every one, in the order given, sharing one tokenizer), the tokenizer and
    its fingerprint."""
    from specdec.train.data import load_teacher

    target, tokenizer = load_teacher(target_dirs[0], placement, accelerator)
    fp = tokenizer_fingerprint(tokenizer)
    teachers = [target]
    for other_dir in target_dirs[1:]:
        other, other_tok = load_teacher(other_dir, placement, accelerator)
        theirs = tokenizer_fingerprint(other_tok)
        if (theirs.get("tokenizer_hash"), theirs.get("vocab_size")) != (fp.get("tokenizer_hash"), fp.get("vocab_size")):
            raise SpecdecError(f"--targets: {other_dir} has another tokenizer than {target_dirs[0]} (vocabulary "
                               f"{theirs.get('vocab_size')}, hash {theirs.get('tokenizer_hash')}; vs {fp.get('vocab_size')}, "
                               f"hash {fp.get('tokenizer_hash')}): the targets of one sorted draft must share a tokenizer")
        if other.config.vocab_size != target.config.vocab_size:
            raise SpecdecError(f"--targets: {other_dir} has vocabulary size {other.config.vocab_size}, "
                               f"{target_dirs[0]} has {target.config.vocab_size}")
        teachers.append(other)
    return teachers, tokenizer, fp


def _student(s: DraftSettings, target, tokenizer, fp: dict, train, placement, seed: int, targets: int):
    """The model that trains: the --init checkpoint (a LoRA adapter on it with --lora), a new draft over
    a reduced vocabulary, or a new draft over the target's; and the reduced vocabulary (None: the whole)."""
    import torch
    from transformers import AutoConfig

    from specdec.train.data import trainable_draft
    from specdec.train.teacher import resolve_draft_vocab

    draft_vocab = resolve_draft_vocab(s.draft_vocab, target.config.vocab_size, possible=not (s.init or s.lora or s.sorted(targets)))
    draft, vocab = None, None
    if s.init:
        init_cfg = read_config(s.init)
        if "specdec_target" in init_cfg:
            check_fingerprint(init_cfg["specdec_target"], fp, f"--init {s.init}")
        if AutoConfig.from_pretrained(s.init).vocab_size != target.config.vocab_size:
            raise SpecdecError(f"--init {s.init} has another vocabulary size than the target")
        draft = trainable_draft(s.init, placement)
    if draft_vocab:
        from specdec.train.teacher import training_vocab

        vocab = training_vocab(train, tokenizer, draft_vocab, target.config.vocab_size)
        torch.manual_seed(seed)
        draft = new_vocab_draft(target, s.arch or "", vocab)
    elif not s.init:
        torch.manual_seed(seed)
        draft = new_draft(target.config, s.arch or "")
    if s.lora:
        from peft import LoraConfig, get_peft_model

        from specdec.models.arch import attention_projections

        # every attention projection, by this architecture's names; none found: peft's default for the model type
        targets_ = attention_projections(draft) or None
        draft = get_peft_model(draft, LoraConfig(r=s.lora_rank, lora_alpha=2 * s.lora_rank, lora_dropout=0.0, target_modules=targets_))
    return draft, vocab


@dataclass
class _Teacher:
    """The teacher's outputs as the loss reads them: cached top-k (``cached``: the first target's; S2D: one
    per target in ``cached_all``), or None (computed on the fly), and how the cache was made."""

    cached: dict | None = None
    cached_all: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    topk: int = 0


def _teacher_outputs(s: DraftSettings, teachers: list, train, vocab, out_dir: Path, cfg: TrainConfig, accelerator):
    """The teacher's top-k outputs cached on disk where the settings ask (a reduced vocabulary always: its
    forward over the draft's tokens is cheap and computed once), and the config with its compute time
    charged to the budget: a run compares at equal minutes, charged as recorded when the cache was made,
    so a resumed run or one reusing the cache gets the same budget as the run that computed it, and
    every process the same number."""
    target = teachers[0]
    out = _Teacher(topk=s.teacher_topk)
    if s.kd_weight <= 0:
        return out, cfg
    if vocab is not None:
        from specdec.train import teacher

        path = Path(s.teacher_cache) if s.teacher_cache else out_dir / "teacher_cache.safetensors"
        start = time.perf_counter()
        if accelerator.is_main_process:
            teacher.build(target, train, path, [], vocab, min(s.teacher_topk, vocab.size - 1),
                          console=lambda m: print(m, file=sys.stderr, flush=True))
        accelerator.wait_for_everyone()
        got = teacher.build(target, train, path, [], vocab, min(s.teacher_topk, vocab.size - 1))
        out.cached = {"values": got["values"].to(accelerator.device), "indices": got["indices"].long().to(accelerator.device)}
        out.seconds = time.perf_counter() - start
        if s.charge_teacher and cfg.budget_minutes > 0:
            cfg = dataclasses.replace(cfg, budget_minutes=max(cfg.budget_minutes - teacher.compute_seconds(path) / 60, 0.01))
        return out, cfg
    if not s.cache_teacher:
        return out, cfg
    from safetensors import safe_open

    start, compute_s = time.perf_counter(), 0.0
    for i, teacher_model in enumerate(teachers):  # S2D: one cache per target
        path = out_dir / ("teacher_cache.safetensors" if i == 0 else f"teacher_cache-{i}.safetensors")
        if accelerator.is_main_process:
            cache_teacher_logits(teacher_model, train, path, min(s.teacher_topk, target.config.vocab_size))
        accelerator.wait_for_everyone()
        with safe_open(str(path), framework="pt") as f:
            compute_s += float(f.metadata()["compute_s"])
            got = {k: f.get_tensor(k).to(accelerator.device) for k in ("values", "indices")}
        got["indices"] = got["indices"].long()  # gather's index type, converted once
        out.cached_all.append(got)
    out.cached = out.cached_all[0]
    out.seconds = time.perf_counter() - start
    if cfg.budget_minutes > 0:
        cfg = dataclasses.replace(cfg, budget_minutes=max(cfg.budget_minutes - compute_s / 60, 0.01))
    return out, cfg


class _draft_loss:
    """The training loss of a draft: KD to the teacher plus CE (``kd_loss``); over the reduced vocabulary's
    ids, at LongSpec's anchor-offset positions under its sinks + window mask (``collate``), or, for S2D,
    each target's depth of one forward distilled from that target (``taps``), averaged over the targets."""

    def __init__(self, s: DraftSettings, draft, teachers: list, vocab, teacher: _Teacher, cfg: TrainConfig, accelerator,
                 target_dirs: list):
        import torch

        self.s, self.draft, self.teachers, self.teacher, self.accelerator = s, draft, teachers, teacher, accelerator
        self.t2d = None if vocab is None else vocab.t2d.to(accelerator.device)
        # no label outside the draft vocabulary
        self.labels_map = None if vocab is None else torch.where(self.t2d == vocab.size - 1, -100, self.t2d)
        self.long_meta, self.collate, self.visible = None, None, None
        if s.long_context:
            from specdec.models.arch import text_config

            max_positions = int(getattr(text_config(draft.config), "max_position_embeddings", 0) or cfg.seq_len)
            self.collate = AnchorCollate(cfg.seed, s.sinks, max_positions)
            self.long_meta = {"window": int(s.window), "sinks": int(s.sinks), "max_positions": max_positions}
            if cfg.seq_len > s.sinks + s.window + 1:
                self.visible = sink_window_visible(cfg.seq_len, s.sinks, s.window).to(accelerator.device)
        # S2D: the depth each target's sub-model has, and the hooks that give every depth from one forward
        self.layers, self.depths, self.taps, self.names = None, [], None, []
        if s.sorted(len(target_dirs)):
            from specdec.models.arch import decoder_layers

            self.layers = len(decoder_layers(draft)[2])
            self.depths = assign_depths([sum(p.numel() for p in t.parameters()) for t in teachers], self.layers,
                                        list(s.s2d_depths) if s.s2d_depths is not None else None)
            self.taps = DepthTaps(draft, self.depths)
            self.names = _target_names(target_dirs)

    def student_kwargs(self, batch) -> dict:
        if not self.s.long_context:
            return {}
        kw = {"position_ids": batch["position_ids"]}
        if self.visible is not None:
            from specdec.models.arch import layer_types
            from specdec.models.masks import additive_mask

            ids = batch["input_ids"]
            mask = additive_mask(self.visible[: ids.shape[1], : ids.shape[1]][None, None].expand(ids.shape[0], 1, -1, -1),
                                 next(self.draft.parameters()).dtype)
            types = sorted(set(layer_types(self.draft.config)))
            kw["attention_mask"] = mask if len(types) == 1 else {t: mask for t in types}
        return kw

    def teacher_of(self, i: int, ids, batch):
        import torch

        if self.s.kd_weight <= 0:
            return None
        if self.teacher.cached_all:
            c = self.teacher.cached_all[i]
            return (c["values"][batch["idx"]], c["indices"][batch["idx"]])
        with torch.no_grad():
            return self.teachers[i](input_ids=ids).logits

    def __call__(self, model, batch):
        s, ids, cached = self.s, batch["input_ids"], self.teacher.cached
        kw = self.student_kwargs(batch)
        if self.t2d is not None:
            logits = model(input_ids=self.t2d[ids], **kw).logits
            teacher_top = (cached["values"][batch["idx"]], cached["indices"][batch["idx"]]) if cached is not None else None
            return kd_loss(logits, ids, teacher_top, s.kd_weight if teacher_top is not None else 0.0, s.temperature, s.ce_labels,
                           labels=self.labels_map[ids])
        logits = model(input_ids=ids, **kw).logits
        if self.taps is None:
            return kd_loss(logits, ids, self.teacher_of(0, ids, batch), s.kd_weight, s.temperature, s.ce_labels)
        total, parts = 0.0, {}
        for i, depth in enumerate(self.depths):
            with self.accelerator.autocast():  # the head in the precision the forward ran in
                sub = self.taps.logits(depth, logits)
            loss, _ = kd_loss(sub, ids, self.teacher_of(i, ids, batch), s.kd_weight, s.temperature, s.ce_labels)
            total = total + loss
            parts[f"loss_t{i}"] = float(loss.detach())
        self.taps.out.clear()
        return total / len(self.depths), parts


def _finish(s: DraftSettings, result, teachers, tokenizer, fp, vocab, held, teacher: _Teacher, loss: _draft_loss,
            cfg: TrainConfig, accelerator, target_dirs, data_files, out_dir: Path) -> dict:
    """The trained draft evaluated on the held-out blocks (S2D: each target at its depth) and written as
    its artifact, with its metrics and training config."""
    target, model = teachers[0], result.model
    evaluated = model
    if vocab is not None:
        from specdec.models.vocab import MappedVocabLM

        evaluated = MappedVocabLM(model, vocab)
    metrics = evaluate_draft(evaluated, target, held, batch=cfg.batch, temperature=s.temperature)
    metrics.update(
        kind="draft", kd_weight=s.kd_weight, temperature=s.temperature, steps=result.steps, stopped=result.stopped,
        train_wall_s=round(result.wall_s, 3), loss_curve=result.losses, final_loss=result.losses[-1] if result.losses else None,
        processes=accelerator.num_processes, teacher="cached-top%d" % teacher.topk if teacher.cached is not None else "on-the-fly",
        teacher_cache_s=round(teacher.seconds, 3), ce_labels=s.ce_labels if s.kd_weight > 0 else "data",
        train_tokens=result.steps * cfg.batch * cfg.grad_accum * cfg.seq_len * accelerator.num_processes,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    if vocab is not None:
        from specdec.train.teacher import heldout_coverage

        metrics.update(draft_vocab=vocab.size, vocab_coverage_heldout=heldout_coverage(vocab, held))
    s2d_meta = None
    if loss.taps is not None:
        from specdec.decode.drafters.draft_model import target_identity
        from specdec.models.views import layer_skip_view

        layers = loss.layers
        s2d_meta = {"depths": dict(zip(loss.names, loss.depths)), "layers": layers, "targets": [], "rule": S2D_RULE}
        per_target = {}
        for i, (name, depth, teacher_model) in enumerate(zip(loss.names, loss.depths, teachers)):
            sub = model if depth >= layers else layer_skip_view(model, list(range(depth, layers)))
            got = evaluate_draft(sub, teacher_model, held, batch=cfg.batch, temperature=s.temperature)
            curve = [log[f"loss_t{i}"] for log in result.logs if f"loss_t{i}" in log]
            per_target[name] = {"depth": depth, "source": str(target_dirs[i]), "loss_curve": curve, **got}
            if i == 0:
                metrics.update(got)  # the top-level held-out metrics: the first target's, at its depth
            s2d_meta["targets"].append({"name": name, "source": str(target_dirs[i]), "depth": depth,
                                        "identity": target_identity(teacher_model.config)})
        metrics["s2d"] = per_target
    long_meta = loss.long_meta
    if long_meta is not None:
        metrics["long_context"] = long_meta
    _save_draft(model, tokenizer, out_dir, fp, s.lora, s.lora_save, s.init, vocab, s2d=s2d_meta, long=long_meta)
    extra = {"targets": [str(t) for t in target_dirs], "s2d_depths": loss.depths} if loss.taps is not None else {}
    if long_meta is not None:
        extra["long_context"] = long_meta
    save_config(cfg, out_dir, {"trainer": "draft", "target": str(target_dirs[0]), "data": [str(f) for f in data_files],
                               "init": str(s.init) if s.init else None, "arch": s.arch, "kd_weight": s.kd_weight,
                               "temperature": s.temperature, "lora": s.lora, "lora_save": s.lora_save,
                               "cache_teacher": s.cache_teacher or vocab is not None, "ce_labels": s.ce_labels, **extra})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def _target_names(sources) -> list[str]:
    """Each target's name in an S2D artifact: its folder's (or hub id's) last part, made unique with ``#i``."""
    names: list[str] = []
    for i, src in enumerate(sources):
        name = str(src).rstrip("/").rsplit("/", 1)[-1] or f"target{i}"
        names.append(name if name not in names else f"{name}#{i}")
    return names


S2D_RULE = ("the depth of the recorded target whose identity (sha256 of its config's architecture fields) is the "
            "decoding target's; of several such, the one whose source or name matches the target's name_or_path; "
            "else the full depth")


def _save_draft(model, tokenizer, out_dir: Path, fp: dict, lora: bool, lora_save: str, init, vocab=None,
                s2d: dict | None = None, long: dict | None = None) -> None:
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
    # S2D: the depth each target's sub-model runs at (decode.drafters.draft_model.s2d_view); LongSpec: the draft's
    # cache keeps the sinks and the window (decode.drafters.long_draft). An --init draft's own are not this one's
    for key, value in (("specdec_s2d", s2d), ("specdec_long", long)):
        config.pop(key, None)
        if value is not None:
            config[key] = value
    write_json(out_dir / "config.json", config)
