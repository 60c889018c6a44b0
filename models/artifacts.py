"""Where models and drafters live, and the one artifact format every drafter kind shares.

An artifact is a directory: config.json (``kind``, ``target`` fingerprint, hyper-parameters),
model.safetensors, metrics.json and the resolved training config. A bare member name such as
``draft`` resolves inside the default family under ``$SPECDEC_HOME``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdec.models.errors import SpecdecError, UsageError  # noqa: F401  (re-exported)

DEFAULT_FAMILY = "tiny-stdlib"
FAMILY_MEMBERS = ("target", "draft", "draft-ce", "acceptance", "medusa", "clover", "eagle", "dllm", "filter")


def specdec_home() -> Path:
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def family_dir(family: str = DEFAULT_FAMILY) -> Path:
    return specdec_home() / family


def resolve_member(name_or_dir: str | os.PathLike, family: str = DEFAULT_FAMILY) -> Path:
    """A path that exists wins; otherwise a bare member name resolves inside the default family."""
    path = Path(name_or_dir)
    if path.exists():
        return path
    if str(name_or_dir) in FAMILY_MEMBERS:
        return family_dir(family) / str(name_or_dir)
    raise SpecdecError(f"no such model or artifact directory: {name_or_dir}")


def read_config(path: str | os.PathLike) -> dict:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        raise SpecdecError(f"{path} has no config.json")
    try:
        return json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"{cfg} is not valid JSON: {exc}") from None


def artifact_kind(path: str | os.PathLike) -> str:
    """The specdec kind of an artifact dir; a plain HF causal LM directory is kind ``draft``."""
    cfg = read_config(path)
    return cfg.get("specdec_kind") or cfg.get("kind") or "draft"


def tokenizer_fingerprint(tokenizer) -> dict:
    """Vocabulary size plus a hash of the vocabulary: two tokenizers agree iff both match."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        digest.update(f"{idx}\t{token}\n".encode("utf-8", "replace"))
    return {"vocab_size": len(vocab), "tokenizer_hash": digest.hexdigest()[:16]}


def check_fingerprint(expected: dict, actual: dict, what: str) -> None:
    if expected.get("tokenizer_hash") != actual.get("tokenizer_hash") or expected.get("vocab_size") != actual.get(
        "vocab_size"
    ):
        raise SpecdecError(
            f"{what} was trained for another tokenizer: it expects vocabulary of size {expected.get('vocab_size')} "
            f"(hash {expected.get('tokenizer_hash')}), the target's has size {actual.get('vocab_size')} "
            f"(hash {actual.get('tokenizer_hash')})"
        )


def write_json(path: str | os.PathLike, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
