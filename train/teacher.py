"""The target's outputs over the training blocks, computed once and kept on disk for every drafter of a
recipe: the hidden states of chosen layers (EAGLE-3's low, middle and high features; ``-1`` is the last,
the one the output layer reads) and the top-k of the target's logits.

With a reduced draft vocabulary (``models.vocab``) the logits are those of the draft's tokens only:
for Gemma 3 that is 16k of 262k rows of the output layer, and the forward costs about the body alone.
Their top-k indices are then draft ids (0 .. N-2; the unk row is never a target), which is all a
drafter over that vocabulary can be trained to say. Keyed like ``train.draft.teacher_cache_key`` (the
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


class HiddenLayers:
    """The cached layers of a batch, indexed as a forward's ``hidden_states`` tuple is (-1: the last)."""

    def __init__(self, layers: dict[int, torch.Tensor], count: int):
        self.layers, self.count = layers, count

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.layers[i if i >= 0 else self.count + i]


def teacher_key(target, dataset, top_k: int, layers: list[int], vocab) -> dict:
    from specdec.train.draft import teacher_cache_key

    key = teacher_cache_key(target, dataset, top_k)
    key["layers"] = ",".join(map(str, layers))
    key["hidden_dtype"] = "bfloat16"
    key["vocab"] = "full" if vocab is None else hashlib.sha256(vocab.d2t.cpu().numpy().tobytes()).hexdigest()[:16]
    return key


def restricted_rows(lm_head_weight: torch.Tensor, vocab) -> torch.Tensor:
    """The output layer's rows of the draft vocabulary's tokens (the unk row excluded), in draft order."""
    return lm_head_weight[vocab.d2t[:-1].to(lm_head_weight.device)]


def build(target, dataset, path: Path, layers: list[int], vocab, top_k: int, batch: int = 4, console=None) -> dict:
    """{"h<i>": [N, T, H] fp16 per layer i (``count``-based index), "values": [N, T, k] fp16, "indices": [N, T, k]
    int32} for the N blocks of ``dataset``, from the file at ``path`` when its key matches."""
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
