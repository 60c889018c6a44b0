"""Lexical Unit Decoding (LUD), approximate: the target fine-tuned by ``specdec train-lud`` (a LoRA, merged)
predicts the next ``m`` tokens at once from a position followed by ``m - 1`` placeholder tokens.

Each step feeds a row's tokens not yet in the cache followed by the placeholders (the first step: the
prompt), reads the greedy token and its probability at the last real position and at each placeholder,
emits the first token always and each next one while its probability is at least ``unit_threshold``
(stopping at the first below), and drops the placeholders' keys and values from the cache before the next
step (``KVState.commit_prefix`` keeps the real tokens' slots; the next forward writes over the rest).
``unit_threshold`` defaults to DEFAULT_THRESHOLD (0.9). A threshold of 1 means units of one token: a
probability is never above 1 and equals it only by rounding, so 1 is taken as "never more than one", and
decoding is then the merged model's own greedy decoding, token for token.

The merged model is a copy of the target that shares every tensor but the adapted projections' weights
(``merged_copy``): the target object the caller holds is not modified. Stats per record: ``new_tokens``,
``target_calls`` (forwards, prefill included), ``units`` (steps), ``tokens_per_step`` and
``approximate: true``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from specdec.decode.engine.own import OwnLoop
from specdec.decode.engine.types import GenRequest, GenResult
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint
from specdec.models.errors import SpecdecError

DEFAULT_THRESHOLD = 0.9
PEFT_PREFIX = "base_model.model."


def build(path, target, tokenizer, options) -> "LudDecoder":
    """The registry's factory for an artifact of kind ``lud``."""
    return LudDecoder(target, tokenizer, options, path)


# ---------------------------------------------------------------------------------------------
# The merged model


def adapter_deltas(artifact: str | Path) -> dict[str, torch.Tensor]:
    """Per adapted module (its path in the base model), the LoRA's weight delta scaling * B @ A (float32),
    read from the peft adapter the artifact holds (plain LoRA: no DoRA, no per-module rank or alpha)."""
    from safetensors.torch import load_file

    folder = Path(artifact)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"{folder}: no readable adapter_config.json ({exc})") from None
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise SpecdecError(f"{folder}: the adapter uses DoRA or per-module ranks, which lud artifacts do not")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = load_file(str(folder / "adapter_model.safetensors"))
    deltas = {}
    for key, a in weights.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise SpecdecError(f"{folder}: unexpected adapter tensor {key} (a lud adapter holds LoRA A/B matrices only)")
            continue
        module = key[: -len(".lora_A.weight")]
        b = weights.get(module + ".lora_B.weight")
        if b is None:
            raise SpecdecError(f"{folder}: {key} has no matching lora_B")
        delta = (b.float() @ a.float()) * scaling
        if config.get("fan_in_fan_out"):
            delta = delta.T
        deltas[module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module] = delta
    if not deltas:
        raise SpecdecError(f"{folder}: the adapter holds no LoRA weights")
    return deltas


def merged_copy(target, deltas: dict[str, torch.Tensor]):
    """A copy of ``target`` with W + delta in each module ``deltas`` names; every other module and tensor is
    shared with the target, which stays as it was. Modules on the way to an adapted one are shallow
    copies with their own child tables. A module whose ``forward`` was replaced on the instance (an
    accelerate hook: it calls the original object) cannot be copied that way: the target is then deep-copied."""
    paths = {name: name.split(".") for name in deltas}
    for name, parts in paths.items():
        node = target
        for part in ["", *parts]:
            if part:
                node = node._modules.get(part) if isinstance(node, torch.nn.Module) else None
            if node is None:
                raise SpecdecError(f"the adapter adapts {name}, which the target does not have")
            if "forward" in node.__dict__:
                return _merged_deep_copy(target, deltas)
        if not isinstance(node, torch.nn.Linear):
            raise SpecdecError(f"the adapter adapts {name}, which is a {type(node).__name__} in the target, not a linear layer")
        if tuple(node.weight.shape) != tuple(deltas[name].shape):
            raise SpecdecError(f"the adapter's {name} is {tuple(deltas[name].shape)}, the target's {tuple(node.weight.shape)}")
    root = _shallow(target)
    for name, parts in paths.items():
        parent = root
        for part in parts[:-1]:
            child = parent._modules[part]
            if not getattr(child, "_lud_copy", False):
                child = _shallow(child)
                parent._modules[part] = child
            parent = child
        linear = parent._modules[parts[-1]]
        new = _shallow(linear)
        new._parameters = type(linear._parameters)(linear._parameters)
        weight = linear.weight.detach()
        merged = (weight.to(_wide(weight.dtype)) + deltas[name].to(weight.device, _wide(weight.dtype))).to(weight.dtype)
        new._parameters["weight"] = torch.nn.Parameter(merged, requires_grad=False)
        parent._modules[parts[-1]] = new
    _clear_marks(root)
    return root  # copies keep their originals' train/eval flags: no call here reaches the shared modules


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _shallow(module):
    out = copy.copy(module)
    out._modules = type(module._modules)(module._modules)
    out._lud_copy = True
    return out


def _clear_marks(module) -> None:
    if module.__dict__.pop("_lud_copy", None):
        for child in module._modules.values():
            if child is not None:
                _clear_marks(child)


def _merged_deep_copy(target, deltas):
    model = copy.deepcopy(target)
    with torch.no_grad():
        for name, delta in deltas.items():
            weight = model.get_submodule(name).weight
            weight.copy_((weight.to(_wide(weight.dtype)) + delta.to(weight.device, _wide(weight.dtype))).to(weight.dtype))
    return model.eval()


# ---------------------------------------------------------------------------------------------
# The decoder


class LudDecoder(OwnLoop):
    """Lexical Unit Decoding over a merged copy of the target (``merged``); greedy only."""

    approximate = True
    argmax_only = True  # the output layer screened (OwnLoop.output_layer)

    def __init__(self, target, tokenizer, options, artifact):
        super().__init__(target, tokenizer, options)
        artifact = Path(artifact)
        cfg = read_config(artifact)
        if (cfg.get("specdec_kind") or cfg.get("kind")) != "lud":
            raise SpecdecError(f"{artifact} is not a lud artifact (specdec_kind {cfg.get('specdec_kind')!r})")
        expected = cfg.get("specdec_target")
        if not expected:
            raise SpecdecError(f"{artifact}: config.json has no specdec_target (the tokenizer it was trained for)")
        check_fingerprint(expected, tokenizer_fingerprint(tokenizer), f"lud artifact {artifact}")
        self.unit_size = int(cfg["unit_size"])
        self.placeholder = int(cfg["placeholder_id"])
        vocab = target.get_input_embeddings().weight.shape[0]
        if self.unit_size < 2 or not 0 <= self.placeholder < vocab:
            raise SpecdecError(f"{artifact}: unit_size {self.unit_size} / placeholder_id {self.placeholder} do not fit the target")
        threshold = getattr(options.drafting, "unit_threshold", None)
        self.threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        self.merged = merged_copy(target, adapter_deltas(artifact))

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        from specdec.decode.engine.cache import KVState

        results: list[GenResult | None] = [None] * len(requests)
        tokens = [[] for _ in requests]
        units = [0] * len(requests)
        active = []
        for i, r in enumerate(requests):
            if r.max_new_tokens <= 0 or not r.prompt_ids:
                results[i] = self._result([], "length", 0)
            else:
                active.append(i)
        if not active:
            return results
        pending = {i: list(requests[i].prompt_ids) for i in active}
        state = KVState(self.merged, len(active), self.device)
        m, g = self.unit_size, self.unit_size - 1
        # the units' tokens are argmaxes and their probabilities only gate them: the screened layer
        with torch.inference_mode(), self.output_layer(self.merged):
            while active:
                width = max(len(pending[i]) for i in active)
                bsz = len(active)
                ids = torch.full((bsz, width + g), self.placeholder, dtype=torch.long)
                valid = torch.ones(bsz, width + g, dtype=torch.bool)
                for row, i in enumerate(active):
                    seq = pending[i]
                    ids[row, : width - len(seq)] = self.placeholder  # holes (never attended to)
                    ids[row, width - len(seq) : width] = torch.tensor(seq, dtype=torch.long)
                    valid[row, : width - len(seq)] = False
                ids, valid = ids.to(self.device), valid.to(self.device)
                solid = bool(valid.all())
                out = state.forward(ids, None if solid and bsz == 1 else valid, logits_to_keep=m)
                state.commit_prefix(width, valid[:, :width])  # the placeholders' slots are dropped
                probs = out.logits[:, -m:].double().softmax(-1)
                p, top = probs.max(-1)
                p, top = p.cpu().tolist(), top.cpu().tolist()
                still = []
                for row, i in enumerate(active):
                    new = [top[row][0]]
                    if self.threshold < 1.0:
                        for j in range(1, m):
                            if p[row][j] < self.threshold:
                                break
                            new.append(top[row][j])
                    units[i] += 1
                    before = len(tokens[i])
                    finish = self.append(tokens[i], new, requests[i].max_new_tokens)
                    if finish is not None:
                        results[i] = self._result(tokens[i], finish, units[i])
                    else:
                        pending[i] = tokens[i][before:]
                        still.append(row)
                if len(still) < len(active):
                    if still:
                        state.select_rows(torch.tensor(still, dtype=torch.long, device=self.device))
                    active = [active[row] for row in still]
        return results

    def _result(self, tokens: list[int], finish: str, units: int) -> GenResult:
        stats = {
            "new_tokens": len(tokens),
            "target_calls": units,  # one forward per step, the prefill's included
            "units": units,
            "tokens_per_step": round(len(tokens) / units, 4) if units else 0.0,
            "approximate": True,
        }
        return GenResult(token_ids=list(tokens), finish_reason=finish, stats=stats)
