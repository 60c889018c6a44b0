"""Recognising a drafter folder written in a published layout (speculators, EAGLE / EAGLE-3 / SpecForge,
Medusa) from its config.json and tensor names alone; ``models.interop`` reads and writes them. Kept apart
so ``models.artifacts`` can name an artifact's kind without importing the converters.
"""

from __future__ import annotations

import os
from pathlib import Path

from specdec.models.errors import SpecdecError

SPECULATORS_VERSION = "0.9.0"  # the release whose loader the exports were checked against

# ---------------------------------------------------------------------------------------------
# recognising a folder's layout


def _weight_keys(folder: Path) -> set[str]:
    """Tensor names of a folder's safetensors files (headers only)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as fh:
                keys.update(fh.keys())
        except Exception:  # a torn or foreign file: the loader that reads it says what is wrong
            continue
    return keys


def foreign_layout(path: str | os.PathLike, cfg: dict | None = None) -> str | None:
    """The published layout of a drafter folder (``speculators``, ``dflash``, ``eagle3``, ``eagle``, ``medusa-hf``,
    ``medusa-vllm``), None for a plain causal LM (a draft model) or a specdec artifact. A folder no
    loader could read, or a layout specdec does not run, raises SpecdecError."""
    folder = Path(path)
    cfg = _read_config(folder) if cfg is None else cfg
    if cfg.get("kind") or cfg.get("specdec_kind"):
        return None
    if "speculators_model_type" in cfg:
        kind = cfg["speculators_model_type"]
        if kind == "dflash":
            return "dflash"
        if kind != "eagle3":
            raise SpecdecError(f"{folder}: speculators draft of type {kind!r}; specdec reads the eagle3 and dflash types "
                               f"(speculators {SPECULATORS_VERSION} has eagle3, mtp, dflash, dflash2, dspark, peagle, xpress)")
        return "speculators"
    if "medusa_num_heads" in cfg:
        return "medusa-hf"
    archs = [str(a) for a in cfg.get("architectures") or []]
    if cfg.get("model_type") == "medusa" or any("Medusa" in a for a in archs):
        return "medusa-vllm"
    if not cfg.get("model_type") and not archs:
        raise SpecdecError(f"{folder}: unknown layout (its config.json names no kind, model_type or architectures; specdec "
                           "reads its own artifacts, Hugging Face models, and speculators eagle3, EAGLE/EAGLE-3/SpecForge and "
                           "Medusa drafts)")
    if any("Eagle3" in a for a in archs) or "draft_vocab_size" in cfg:
        return "eagle3"
    if any(a.startswith("Eagle") for a in archs):
        return "eagle"
    keys = _weight_keys(folder)
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys) and not any(k.startswith("model.") for k in keys):
        return "eagle"
    return None


def foreign_kind(path: str | os.PathLike, cfg: dict | None = None) -> str | None:
    """The specdec drafter kind a published layout decodes as (eagle, medusa or block), None if not one."""
    layout = foreign_layout(path, cfg)
    if layout is None:
        return None
    return "medusa" if layout.startswith("medusa") else "block" if layout == "dflash" else "eagle"




def _read_config(folder: Path) -> dict:
    import json

    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecdecError(f"{folder} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"{folder / 'config.json'} is not valid JSON: {exc}") from None
