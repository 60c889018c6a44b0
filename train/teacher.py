"""The target's outputs over the training blocks, computed once and kept on disk for every drafter of a
recipe: the hidden states of chosen layers (EAGLE-3's low, middle and high features; ``-1`` is the last,
the one the output layer reads) and the top-k of the target's logits.

With a reduced draft vocabulary (``models.vocab``) the logits are those of the draft's tokens only:
for Gemma 3 that is 16k of 262k rows of the output layer, and the forward costs about the body alone.
Their top-k indices are then draft ids (0 .. N-2; the unk row is never a target), which is all a
drafter over that vocabulary can be trained to say. Keyed like ``teacher_cache_key`` (the
blocks' tokens, the target's weights, k) plus the layers and the vocabulary; recomputed when any differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models.errors import UsageError


class HiddenLayers:
    """The cached layers of a batch, indexed as a forward's ``hidden_states`` tuple is (-1: the last)."""

    def __init__(self, layers: dict[int, torch.Tensor], count: int):
        self.layers, self.count = layers, count

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.layers[i if i >= 0 else self.count + i]


def teacher_key(target, dataset, top_k: int, layers: list[int], vocab) -> dict:
    key = teacher_cache_key(target, dataset, top_k)
    key["layers"] = ",".join(map(str, layers))
    key["hidden_dtype"] = "bfloat16"
    key["vocab"] = "full" if vocab is None else hashlib.sha256(vocab.d2t.cpu().numpy().tobytes()).hexdigest()[:16]
    return key


def restricted_rows(lm_head_weight: torch.Tensor, vocab) -> torch.Tensor:
    """The output layer's rows of the draft vocabulary's tokens (the unk row excluded), in draft order."""
    return lm_head_weight[vocab.d2t[:-1].to(lm_head_weight.device)]


def teacher_batch(device, seq_len: int, count: int, hidden: int, rows: int, budget_bytes: float = 2e9) -> int:
    """Blocks per teacher forward: 4 on a CPU (larger batches buy nothing there); on a GPU as many as keep one
    forward's float32 hidden states of every layer and its logits within ``budget_bytes``. On an H200, 4 blocks
    of 256 tokens a forward ran Gemma 3 270M's teacher pass at 28k tokens a second: launches, not arithmetic."""
    if device.type != "cuda":
        return 4
    per_block = seq_len * (count * hidden + rows) * 4
    return max(4, min(256, int(budget_bytes // max(per_block, 1))))


def build(target, dataset, path: Path, layers: list[int], vocab, top_k: int, batch: int | None = None, console=None) -> dict:
    """{"h<i>": [N, T, H] fp16 per layer i (``count``-based index), "values": [N, T, k] fp16, "indices": [N, T, k]
    int32} for the N blocks of ``dataset``, from the file at ``path`` when its key matches. ``batch``: blocks
    per forward (default ``teacher_batch``'s)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    count = target.config.get_text_config().num_hidden_layers + 1  # hidden_states: the embeddings, then each layer
    layers = sorted({i if i >= 0 else count + i for i in layers})
    key = teacher_key(target, dataset, top_k, layers, vocab)
    if path.exists():
        try:
            with safe_open(str(path), framework="pt") as fh:
                stored = json.loads((fh.metadata() or {}).get("specdec_teacher", "{}"))
                have = {int(x) for x in stored.get("layers", "").split(",") if x}
                # a cache of more layers serves a drafter that reads fewer (the recipe's drafters share one)
                if {k: v for k, v in stored.items() if k != "layers"} == {k: v for k, v in key.items() if k != "layers"} \
                        and set(layers) <= have:
                    wanted = {f"h{i}" for i in layers} | {"values", "indices"}
                    return {k: fh.get_tensor(k) for k in fh.keys() if k in wanted} | {"_count": count}
        except Exception:  # a torn or foreign file: recomputed below
            pass
        print(f"teacher cache {path}: computed for other inputs or unreadable; recomputing", file=sys.stderr)
    start = time.perf_counter()
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    weight = target.get_output_embeddings().weight
    rows = restricted_rows(weight, vocab) if vocab is not None else weight
    out: dict[str, list] = {f"h{i}": [] for i in layers} | {"values": [], "indices": []}
    device = weight.device
    n = len(dataset)
    if batch is None:
        seq = int(dataset[0]["input_ids"].shape[-1]) if n else 1
        batch = teacher_batch(device, seq, count, target.config.get_text_config().hidden_size, rows.shape[0])
    with torch.inference_mode():
        for i in range(0, n, batch):
            ids = dataset[i : i + batch]["input_ids"].to(device)
            res = base(input_ids=ids, output_hidden_states=True)
            hs = res.hidden_states
            for j in layers:  # bf16: Gemma's residual stream reaches past fp16's 65504 in its middle layers
                out[f"h{j}"].append(hs[j].to(torch.bfloat16).cpu())
            logits = F.linear(hs[-1], rows).float()
            v, ix = logits.topk(top_k, dim=-1)
            out["values"].append(v.half().cpu())
            out["indices"].append(ix.int().cpu())
            if console is not None and (i // batch) % 25 == 0:
                rate = (i + len(ids)) * ids.shape[1] / (time.perf_counter() - start)
                console(f"teacher: {i + len(ids)}/{n} blocks ({rate:.0f} tokens/s)")
    tensors = {k: torch.cat(v) for k, v in out.items()}
    meta = {"specdec_teacher": json.dumps(key, sort_keys=True), "compute_s": repr(time.perf_counter() - start)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return tensors | {"_count": count}


def compute_seconds(path: Path) -> float:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return float((fh.metadata() or {}).get("compute_s", 0.0))


def batch_layers(cache: dict, idx: torch.Tensor, dtype=torch.float32) -> HiddenLayers:
    """The cached layers of the blocks ``idx`` as a ``hidden_states``-like object."""
    layers = {int(k[1:]): v[idx].to(dtype) for k, v in cache.items() if k.startswith("h")}
    return HiddenLayers(layers, cache["_count"])


# -- shared by the trainers ----------------------------------------------------------------------


TEACHER_CACHE_FORMAT = "1"


def teacher_cache_key(target, dataset, top_k: int) -> dict:
    """What a teacher cache was computed from: the training blocks' token ids (their sha256), the
    target (its config and a checksum of strided samples of every weight), top-k and block length.

    The weight checksum reads about 8k values per tensor, so it costs milliseconds on a large
    target yet changes with any retraining or merge that moves a tensor's values broadly."""
    import torch

    data = hashlib.sha256()
    n = len(dataset)
    for i in range(0, n, 1024):
        ids = dataset[i : i + 1024]["input_ids"].to(torch.int64).contiguous()
        data.update(ids.numpy().tobytes())
    seq_len = int(dataset[0]["input_ids"].shape[-1]) if n else 0
    config = target.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        config.pop(volatile, None)
    weights = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in sorted(target.state_dict().items()):
            weights.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
            if t.device.type == "meta":  # offloaded by a device map: its values are not at hand
                continue
            flat = t.detach().reshape(-1)
            stride = max(1, flat.numel() // 4096)
            sample = torch.cat([flat[:2048], flat[::stride], flat[-2048:]]).to("cpu", torch.float64).contiguous()
            weights.update(sample.numpy().tobytes())
    return {"format": TEACHER_CACHE_FORMAT, "data": data.hexdigest(), "target": weights.hexdigest(),
            "top_k": str(top_k), "seq_len": str(seq_len), "blocks": str(n)}


def eval_batch(batch: int, heldout, target, budget_bytes: float = 1.5e9) -> int:
    """Held-out blocks per evaluation forward: at most ``batch``, and few enough that one forward's float32
    logits stay within ``budget_bytes`` (a 262k vocabulary makes 16 blocks of 256 tokens 4.3 GB, several
    copies of which an evaluation holds at once)."""
    if not len(heldout):
        return max(1, batch)
    seq = int(heldout[0]["input_ids"].shape[-1])
    return max(1, min(batch, int(budget_bytes // (seq * target.config.vocab_size * 4))))


LARGE_VOCAB = 65536  # a target vocabulary this large makes the output layer most of a small drafter's cost
AUTO_DRAFT_VOCAB = 32768  # the default draft vocabulary there (EAGLE-3's published drafts of 128k-token targets use 32k)


def resolve_draft_vocab(requested: int | None, target_vocab: int, possible: bool = True) -> int | None:
    """The draft vocabulary a trainer builds: ``requested`` as given (0: the target's whole vocabulary, None
    returned), or by default ``AUTO_DRAFT_VOCAB`` entries for a target of ``LARGE_VOCAB`` tokens or more
    where the drafter can take one (``possible``), the whole vocabulary otherwise. Each drafted token then
    reads 32k rows of an output layer instead of, for Gemma 3, 262k; coverage is reported in the metrics."""
    if requested is None:
        return AUTO_DRAFT_VOCAB if possible and target_vocab >= LARGE_VOCAB else None
    return requested or None


def training_vocab(train, tokenizer, size: int, target_vocab: int):
    """The ``size``-entry draft vocabulary of the training blocks' most frequent tokens (special tokens first)."""
    from collections import Counter

    from specdec.models.vocab import most_frequent

    if size < 2 or size > target_vocab:
        raise UsageError(f"--draft-vocab must be in 2..{target_vocab} (the target's vocabulary), not {size}")
    counts: Counter = Counter()
    for i in range(0, len(train), 256):
        counts.update(train[i : i + 256]["input_ids"].reshape(-1).tolist())
    special = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None]
    return most_frequent(counts, size, target_vocab, always=special)


def heldout_coverage(vocab, held) -> float | None:
    """Share of the held-out blocks' tokens inside the draft vocabulary (None without held-out blocks)."""
    if not len(held):
        return None
    ids = held[:]["input_ids"].reshape(-1)
    inside = torch.zeros(vocab.target_vocab, dtype=torch.bool)
    inside[vocab.d2t[:-1].cpu()] = True
    return round(float(inside[ids].float().mean()), 4)
