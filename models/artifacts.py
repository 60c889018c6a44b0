"""Where models and drafters live, and the one artifact format every drafter kind shares.

An artifact is a directory: config.json (``kind``, ``target`` fingerprint, hyper-parameters),
model.safetensors (or shards of it listed by model.safetensors.index.json, as transformers writes
them), metrics.json and the resolved training config. A bare member name such as ``draft``
resolves inside the default family, Gemma 3 270M: its drafters ship with specdec (``families/``),
its target is converted from its registry package on first use. ``FAMILY/MEMBER`` names a member
of another family (``tiny-stdlib/draft``: built by ``specdec recipe run tiny-stdlib``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdec.models.env import specdec_home  # noqa: F401  (re-exported)
from specdec.models.errors import SpecdecError, UsageError  # noqa: F401  (re-exported)

FAMILY_MEMBERS = ("target", "draft", "draft-ce", "acceptance", "medusa", "clover", "eagle", "eagle3", "dllm", "filter")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "families"  # drafters committed with specdec
# the default family: Gemma 3 270M, its target converted from its registry package on first use
# (models.gguf), its drafters shipped in SHIPPED_DIR
DEFAULT_FAMILY = "gemma3-270m"
BUILT_FAMILY = "tiny-stdlib"  # the from-scratch CPU family the tests' recipes and `recipe run tiny-stdlib` build
FAMILIES = (DEFAULT_FAMILY, BUILT_FAMILY, "pycode")


def built_dir(family: str) -> Path:
    """Where ``specdec recipe run FAMILY`` builds the family: $SPECDEC_HOME/FAMILY."""
    return specdec_home() / family


def family_dir(family: str | None = None) -> Path:
    """Where a family's members are read: the default family's drafters ship with specdec; another
    family's folder is the one shipped with specdec when it holds a target, else the one its recipe
    builds under $SPECDEC_HOME."""
    family = family or DEFAULT_FAMILY
    shipped = SHIPPED_DIR / family
    if family == DEFAULT_FAMILY or (shipped / "target" / "config.json").is_file():
        return shipped
    return built_dir(family)


def family_member(name: str, family: str | None = None) -> Path:
    """A member of a family (the default one when ``family`` is None). The default family's target is
    converted from its package on first use; a shipped family holds the members that fit its size cap,
    and asking for another is an error rather than a silent switch of families."""
    family = family or DEFAULT_FAMILY
    if name == "target" and family == DEFAULT_FAMILY:
        from specdec.models.gguf import gemma_target

        return gemma_target()
    fam = family_dir(family)
    if fam.parent == SHIPPED_DIR and not (fam / name).is_dir():
        shipped = ", ".join(m for m in FAMILY_MEMBERS if (fam / m).is_dir()) or "no drafters"
        raise SpecdecError(f"the {family} family ({fam}) does not ship {name!r} (it has {shipped}); "
                           f"pass an artifact folder, or train it with `specdec recipe run {family}`")
    return fam / name


def family_spec(name: str) -> tuple[str, str] | None:
    """(family, member) for ``FAMILY`` (its target) or ``FAMILY/MEMBER``; None for anything else."""
    family, _, member = str(name).partition("/")
    if family in FAMILIES and (member in FAMILY_MEMBERS or not member):
        return family, member or "target"
    return None


WINNER_FILE = "fastest.json"  # a family's fastest lossless method, as measured: {"method", "summary", "report"}


def family_of(source: str | os.PathLike) -> str | None:
    """The family whose target the folder ``source`` is, found without converting or loading anything."""
    path = Path(source)
    if not path.is_dir():
        return None
    path = path.resolve()
    for family in FAMILIES:
        if family == DEFAULT_FAMILY:
            from specdec.models.gguf import gemma_dir

            target = gemma_dir()
        else:
            target = family_dir(family) / "target"
        if target is not None and target.exists() and target.resolve() == path:
            return family
    return None


def family_winner(source: str | os.PathLike) -> dict | None:
    """For a family's target: {"family", "method" (a spec), "summary", "when", "otherwise"} from the family's
    ``fastest.json``, when it names a drafter that needs nothing (``ngram``) or a member the family holds; else None.
    ``when``: the decode options it was measured under (``batch_size``, ``temperature``), where it is the fastest;
    ``otherwise``: rules of the same form ({"method", "summary", "when"}) for other conditions, the first whose
    ``when`` holds deciding there."""
    family = family_of(source)
    if family is None:
        return None
    fam = family_dir(family)
    if not (fam / WINNER_FILE).is_file():
        return None
    info = json.loads((fam / WINNER_FILE).read_text())
    method = _shipped_method(family, str(info["method"]))
    if method is None:
        return None
    # where the winner was not measured: other conditions' fastest methods (``ar`` where no drafter paid there)
    otherwise = []
    for rule in info.get("otherwise") or []:
        found = _shipped_method(family, str(rule["method"]))
        if found is not None:
            otherwise.append({"method": found, "summary": str(rule.get("summary", "")), "when": dict(rule.get("when") or {})})
    return {"family": family, "method": method, "summary": str(info.get("summary", "")), "when": dict(info.get("when") or {}),
            "otherwise": otherwise}


def _shipped_method(family: str, method: str) -> str | None:
    """A method spec (a drafter and the options it was measured with, ``NAME+key=value``) as a decode names it:
    a family member's under the family (None where the family does not hold it), any other as it is."""
    head, plus, rest = method.partition("+")
    if head in FAMILY_MEMBERS:
        if not (family_dir(family) / head).is_dir():
            return None
        return f"{family}/{head}{plus}{rest}"
    return method


def resolve_member(name_or_dir: str | os.PathLike, family: str | None = None) -> Path:
    """A path that exists wins; otherwise a bare member name resolves inside the default family, and
    ``FAMILY/MEMBER`` inside that family."""
    path = Path(name_or_dir)
    if path.exists():
        return path
    if str(name_or_dir) in FAMILY_MEMBERS:
        return family_member(str(name_or_dir), family)
    spec = family_spec(str(name_or_dir))
    if spec is not None:
        return family_member(spec[1], spec[0])
    raise SpecdecError(f"no such model or artifact directory: {name_or_dir}")


PART = ".__part"  # a tensor larger than a shard is stored as row blocks NAME.__partIofN (I from 0)


def load_weights(artifact_dir: str | os.PathLike) -> dict:
    """An artifact's tensors: model.safetensors, or every shard its model.safetensors.index.json lists
    (a tensor stored as row blocks joined again)."""
    from safetensors.torch import load_file

    folder = Path(artifact_dir)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(folder / "model.safetensors"))
    weights: dict = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        weights.update(load_file(str(folder / shard)))
    parts: dict = {}
    for key in [k for k in weights if PART in k]:
        name, _, tail = key.rpartition(PART)
        parts.setdefault(name, {})[int(tail.partition("of")[0])] = weights.pop(key)
    if parts:
        import torch

        for name, blocks in parts.items():
            weights[name] = torch.cat([blocks[i] for i in range(len(blocks))], dim=0)
    return weights


def save_weights(state: dict, artifact_dir: str | os.PathLike, max_shard_bytes: int | None = None) -> list[Path]:
    """Write ``state`` as model.safetensors, or as shards of at most ``max_shard_bytes`` with the index
    transformers writes; a tensor larger than a shard is cut into row blocks (``PART``) that
    ``load_weights`` joins. Returns the files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    folder = Path(artifact_dir)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if max_shard_bytes is None:
        save_file(state, str(folder / "model.safetensors"))
        return [folder / "model.safetensors"]
    cut: dict = {}
    for k, v in state.items():
        size = v.numel() * v.element_size()
        if size <= max_shard_bytes or v.dim() == 0 or v.shape[0] < 2:
            cut[k] = v
            continue
        n = min(-(-size // max_shard_bytes), v.shape[0])
        for i, block in enumerate(v.tensor_split(n, dim=0)):
            cut[f"{k}{PART}{i}of{n}"] = block.clone()  # a view would share its storage: one shard for all blocks
    state = cut
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_bytes)
    files = []
    for name, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in keys}, str(folder / name), metadata={"format": "pt"})
        files.append(folder / name)
    if split.is_sharded:
        write_json(folder / "model.safetensors.index.json", {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
        files.append(folder / "model.safetensors.index.json")
    return files


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
    kind = cfg.get("specdec_kind") or cfg.get("kind")
    if kind:
        return kind
    from specdec.models.layouts import foreign_kind  # a draft in a published layout (EAGLE, speculators, Medusa)

    return foreign_kind(path, cfg) or "draft"


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
