"""Options, method specs, model loading and the registry of drafter kinds.

A method spec is a drafter followed by ``+key=value`` options, e.g. ``draft+k=4``,
``draft+acceptance=acceptance``, ``eagle+tree=dynamic+tree-tokens=32``. The keys are the
``DecodeOptions`` fields (dashes or underscores), the same options ``specdec decode`` takes as flags.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.decode.artifacts import (
    SpecdecError,
    UsageError,
    artifact_kind,
    check_fingerprint,
    read_config,
    resolve_member,
    tokenizer_fingerprint,
)

MODEL_FREE = ("ar", "ngram", "recycle", "layerskip")
OPTION_ALIASES = {"k": "num_draft", "gamma": "num_draft"}


@dataclass
class DecodeOptions:
    drafter: str = "ar"
    num_draft: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    stop: list = field(default_factory=list)
    # adaptive draft length (SpecDec++)
    acceptance: str | None = None
    # None: the acceptance artifact's default policy for the decode mode (decode/adaptive.resolve_policies)
    stop_threshold: float | None = None
    min_draft: int | None = None
    max_draft: int | None = None
    # token trees
    tree: str = "static"
    tree_tokens: int | None = None
    top_k: int | None = None  # children per expanded node (static: per head/depth; dynamic: frontier width)
    # n-gram drafter
    max_ngram: int = 3
    # diffusion decoding
    strategy: str = "static"
    gen_length: int | None = None
    block_size: int = 32
    steps: int | None = None
    cache: str = "none"
    filter: str | None = None
    adablock: bool = False
    # execution
    kernels: str = "auto"
    threads: int = 0  # 0: one intra-op thread on CPU (tiny forwards lose more to thread sync than they gain)
    dtype: str = "float32"
    trust_remote_code: bool = False

    def with_overrides(self, overrides: dict) -> "DecodeOptions":
        types = {f.name: f.type for f in dataclasses.fields(self)}
        changes = {}
        for raw_key, raw in overrides.items():
            key = OPTION_ALIASES.get(raw_key, raw_key).replace("-", "_")
            if key not in types:
                raise UsageError(f"unknown option {raw_key!r} (known: {', '.join(sorted(types))})")
            changes[key] = _convert(raw, types[key], raw_key)
        return dataclasses.replace(self, **changes)


def _convert(raw, typ: str, key: str):
    if not isinstance(raw, str):
        return raw
    typ = str(typ)
    try:
        if typ.startswith("int"):
            return int(raw)
        if typ.startswith("float"):
            return float(raw)
        if typ.startswith("bool"):
            return raw.lower() in ("1", "true", "yes", "on")
        if typ.startswith("list"):
            return raw.split("|")
    except ValueError as exc:
        raise UsageError(f"option {key}={raw!r}: {exc}") from None
    return raw


def parse_method(spec: str) -> tuple[str, dict]:
    """``draft+k=4+tree-tokens=32`` -> ("draft", {"k": "4", "tree-tokens": "32"})."""
    head, *opts = spec.split("+")
    overrides = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or not key:
            raise UsageError(f"method {spec!r}: option {opt!r} is not key=value")
        overrides[key] = value
    if not head:
        raise UsageError(f"method {spec!r} names no drafter")
    return head, overrides


# -- models ------------------------------------------------------------------------------------


def torch_dtype(name: str):
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}") from None


def load_causal_lm(path: Path, options: DecodeOptions, device=None):
    """Safetensors only; remote code only when the user passed --trust-remote-code."""
    from transformers import AutoModelForCausalLM

    if not any(path.glob("*.safetensors")):
        raise SpecdecError(f"{path}: no .safetensors weights (specdec never loads pickled checkpoints)")
    model = AutoModelForCausalLM.from_pretrained(
        path,
        use_safetensors=True,
        trust_remote_code=options.trust_remote_code,
        dtype=torch_dtype(options.dtype),
        attn_implementation="sdpa",
    )
    if device is not None:
        model.to(device)
    if kernel_backend(options, device) == "triton":
        from specdec.kernels.tree_attention import register

        model.set_attn_implementation(register())
    return model.eval()


def kernel_backend(options: DecodeOptions, device=None) -> str:
    from specdec.kernels import backend

    return backend(options.kernels, device)


def apply_threads(options: DecodeOptions) -> None:
    import torch

    torch.set_num_threads(options.threads or 1)


def load_tokenizer(path: Path, options: DecodeOptions):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=options.trust_remote_code)


def load_target(target: str, options: DecodeOptions, device=None):
    path = resolve_member(target)
    return load_causal_lm(path, options, device), load_tokenizer(path, options), path


# -- drafters ----------------------------------------------------------------------------------


def _build_draft(path: Path, target, tokenizer, options: DecodeOptions):
    from specdec.decode.drafters import ModelDrafter

    cfg = read_config(path)
    expected = cfg.get("specdec_target")
    actual = tokenizer_fingerprint(tokenizer)
    if expected:
        check_fingerprint(expected, actual, f"draft {path}")
    elif (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        check_fingerprint(tokenizer_fingerprint(load_tokenizer(path, options)), actual, f"draft {path}")
    elif cfg.get("vocab_size") != target.config.vocab_size:
        raise SpecdecError(
            f"draft {path} has vocabulary size {cfg.get('vocab_size')}, the target's is {target.config.vocab_size}"
        )
    device = next(target.parameters()).device
    if (path / "adapter_config.json").exists():  # a LoRA adapter saved by train-draft --lora-save adapter
        model = _hook("specdec.train.draft", "load_draft")(path).to(device).eval()
    else:
        model = load_causal_lm(path, options, device)
    if options.acceptance:
        adaptive = _hook("specdec.decode.adaptive", "build_adaptive")
        return adaptive(resolve_member(options.acceptance), model, options, tokenizer=tokenizer)
    return ModelDrafter(model)


def _hook(module: str, name: str) -> Callable:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SpecdecError(f"this installation has no {module}.{name}: {exc}") from None


# kind (config.json "specdec_kind"/"kind") -> factory(path, target, tokenizer, options)
DRAFTER_KINDS: dict[str, Callable] = {
    "draft": _build_draft,
    "medusa": lambda *a: _hook("specdec.decode.heads", "build_drafter")(*a),
    "clover": lambda *a: _hook("specdec.decode.heads", "build_drafter")(*a),
    "eagle": lambda *a: _hook("specdec.decode.heads", "build_drafter")(*a),
}


def build_drafter(spec: str, target, tokenizer, options: DecodeOptions):
    from specdec.decode import drafters

    name = spec.split(":")[0]
    if name == "ar":
        return drafters.NoDrafter()
    if name == "ngram":
        return drafters.NgramDrafter(max_ngram=options.max_ngram)
    if name == "recycle":
        return drafters.RecycleDrafter()
    if name == "layerskip":
        skip = drafters.parse_layerskip(spec, target.config.num_hidden_layers)
        return drafters.ModelDrafter(drafters.layer_skip_view(target, skip))
    path = resolve_member(spec)
    kind = artifact_kind(path)
    if kind not in DRAFTER_KINDS:
        raise SpecdecError(f"{path}: artifact kind {kind!r} is not a drafter (known: {', '.join(DRAFTER_KINDS)})")
    return DRAFTER_KINDS[kind](path, target, tokenizer, options)
