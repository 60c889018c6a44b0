"""Head artifacts: build a head module of a kind (specdec's Medusa / Clover / EAGLE, or a published EAGLE
architecture from ``models.interop``), save it in specdec's artifact format, load it back attached to
its target."""

from __future__ import annotations

from pathlib import Path

from specdec.models.artifacts import load_weights, read_config, write_json
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.heads import KINDS, RIDE_KINDS, ChimeraHeads, CloverHeads, EagleHead, MedusaHeads, PromptTokens, TransferMaps


# ---------------------------------------------------------------------------------------------
# Build, train, save, load


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high feature layers (indices into a forward's hidden states)."""
    n = num_layers
    return sorted({min(2, n), max(n // 2, 1), max(n - 3, 1)})


def build_heads(kind: str, target, hp: dict):
    cfg = target.config
    if kind == "medusa":
        m = MedusaHeads(cfg.hidden_size, cfg.vocab_size, int(hp.get("num_heads", 4)), int(hp.get("num_layers", 1)),
                        shared_head=bool(hp.get("shared_head", False)))
    elif kind == "clover":
        m = CloverHeads(cfg.hidden_size, cfg.vocab_size, int(hp.get("num_heads", 4)), int(hp.get("attn_heads", cfg.num_attention_heads)),
                        int(hp.get("window", 64)))
    elif kind == "chimera":
        m = ChimeraHeads(cfg.hidden_size, cfg.vocab_size, int(hp.get("num_heads", 4)), int(hp.get("num_layers", 1)),
                         int(hp.get("attn_heads", cfg.num_attention_heads)), int(hp.get("window", 64)))
    elif kind == "eagle" and hp.get("layout"):  # EAGLE-1 / EAGLE-3 as published (models/interop.py)
        from specdec.models.interop import build_published_eagle  # a module above heads: no cycle

        m = build_published_eagle(target, hp)
    elif kind == "eagle":
        layers = hp.get("feature_layers")
        if layers == "eagle3" or (hp.get("eagle3") and not layers):
            layers = eagle3_layers(cfg.num_hidden_layers)
        m = EagleHead(cfg, layers, float(hp.get("noise", 0.2)), float(hp.get("ce_weight", 0.1)), float(hp.get("reg_weight", 1.0)),
                      int(hp.get("unroll", 7 if hp.get("eagle3") else 1)), fspad=bool(hp.get("fspad")),
                      fspad_align=float(hp.get("fspad_align") or 0.5))
    elif kind == "block":  # all K drafts of a round in one forward (models.block)
        from specdec.models.block import BlockHead

        layers = hp.get("feature_layers")  # default EAGLE-3's three; "last": the last layer alone
        layers = eagle3_layers(cfg.num_hidden_layers) if layers in (None, "eagle3") else (None if layers == "last" else layers)
        layout = str(hp.get("layout") or "specdec")
        if layout == "published" and layers is None:
            raise UsageError("--layout published (DFlash's) fuses chosen target layers: --feature-layers last is specdec's layout only")
        mask = hp.get("mask_token_id")
        m = BlockHead(cfg, int(hp.get("num_heads") or 4), int(hp.get("num_layers") or 1), layers,
                      int(hp.get("anchors") or 64), str(hp.get("loss") or "kl"), layout,
                      None if mask is None else int(mask)).init_from_target(target)
    elif kind == "ppd":  # riding the target's forward (decode.drafters.parallel_prompts)
        m = PromptTokens(cfg.hidden_size, int(hp.get("num_heads") or 3), int(hp.get("placeholder") or 0), int(hp.get("ensemble") or 1))
    elif kind == "hidden-transfer":
        layer = hp.get("layer")
        m = TransferMaps(cfg.hidden_size, cfg.num_hidden_layers, int(hp.get("num_heads") or 3), int(hp.get("placeholder") or 0),
                         None if layer is None else int(layer))
    else:
        raise UsageError(f"--kind must be one of {', '.join(KINDS + RIDE_KINDS)}, not {kind!r}")
    return m


def save_heads(heads, out_dir: Path, fingerprint: dict, target_config) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # float weights in float32; integer tensors (a reduced vocabulary's target ids) stay integers: a later
    # cast to bf16 (shipping) would round ids above 256
    save_file({k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous() for k, v in heads.state_dict().items()},
              str(out_dir / "model.safetensors"))
    extra = {}
    if heads.d2t is not None:
        from specdec.models.vocab import DraftVocab

        DraftVocab(heads.d2t.cpu(), target_config.vocab_size).save(out_dir)
        extra["draft_vocab_size"] = len(heads.d2t)
    write_json(out_dir / "config.json", {
        "kind": heads.kind, "target": fingerprint, "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size, "num_hidden_layers": target_config.num_hidden_layers, **heads.hparams(), **extra,
    })


def load_heads(artifact_dir: str | Path, target):
    """A head module from its artifact, attached to ``target`` (weights through safetensors only)."""
    from specdec.models.loading import cached

    return cached(("heads", str(artifact_dir), id(target)), lambda: _load_heads(artifact_dir, target))


def _load_heads(artifact_dir: str | Path, target):
    cfg = read_config(artifact_dir)
    kind = cfg.get("kind")
    if kind not in KINDS + RIDE_KINDS:
        raise SpecdecError(f"{artifact_dir} is not a {'/'.join(KINDS + RIDE_KINDS)} artifact (kind {kind!r})")
    if cfg.get("hidden_size") != target.config.hidden_size or cfg.get("vocab_size") != target.config.vocab_size:
        raise SpecdecError(f"{artifact_dir} was trained for a target with hidden size {cfg.get('hidden_size')} and "
                           f"vocabulary {cfg.get('vocab_size')}; this target has {target.config.hidden_size} and {target.config.vocab_size}")
    heads = build_heads(kind, target, cfg)
    heads.load_state_dict(load_weights(artifact_dir))
    from specdec.models import vocab as draft_vocab

    reduced = draft_vocab.load(artifact_dir)
    if reduced is not None:
        heads.set_vocab(reduced)
    p = next(target.parameters())
    return heads.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False).attach(target), cfg
