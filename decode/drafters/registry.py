"""The registry of drafter kinds, and loading a target for decoding.

A drafter spec is a model-free name (``ar``, ``ngram``, ``recycle``, ``layerskip[:i,j]``,
``retrieval:INDEX``), a default family member (``draft``, ``medusa``, ...) or an artifact folder; an
artifact's ``config.json`` says its kind (``specdec_kind`` or ``kind``), and ``DRAFTER_KINDS`` maps the
kind to its factory. The CLI never branches on names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from specdec.decode.drafters import aded
from specdec.decode.drafters import copying
from specdec.decode.drafters import base, draft_model, model_free
from specdec.decode.drafters import retrieval
from specdec.decode.drafters import stand
from specdec.decode.drafters import self_speculation as swift
from specdec.decode.drafters.adaptive import build_adaptive
from specdec.decode.drafters.heads import build_head_drafter
from specdec.decode.options import DecodeOptions
from specdec.decode.engine.verify import TREE_SCHEMES
from specdec.models.artifacts import FAMILY_MEMBERS, artifact_kind, check_fingerprint, read_config, resolve_member, tokenizer_fingerprint
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.loading import input_device, load_draft, load_model_config, load_target, load_tokenizer, resolve_source

def _layerskip(spec: str, target, tokenizer, options: DecodeOptions):
    skip = swift.parse_layerskip(spec, target.config.num_hidden_layers) or swift.search_layerskip(target, tokenizer)
    return draft_model.ModelDrafter(swift.layer_skip_view(target, skip))


# drafters that need no artifact: name -> factory(spec, target, tokenizer, options), as DRAFTER_KINDS' factories
MODEL_FREE_DRAFTERS: dict[str, Callable] = {
    "ar": lambda spec, target, tokenizer, options: base.NoDrafter(),
    "ngram": lambda spec, target, tokenizer, options: model_free.NgramDrafter(max_ngram=options.max_ngram),
    "recycle": lambda spec, target, tokenizer, options: model_free.RecycleDrafter(),
    "layerskip": _layerskip,
    "copy": lambda spec, target, tokenizer, options: copying.CopyDrafter(),
    "input-copy": lambda spec, target, tokenizer, options: copying.InputCopyDrafter(),
    "swift": swift.build_swift,
    "aded": lambda spec, target, tokenizer, options: aded.AdedDrafter(),
    "stand": lambda spec, target, tokenizer, options: stand.StandDrafter(),
    "retrieval": retrieval.build_retrieval,
}
MODEL_FREE = tuple(MODEL_FREE_DRAFTERS)


def kernel_backend(options: DecodeOptions, device=None) -> str:
    from specdec.kernels import BACKENDS, backend

    try:
        return backend(options.kernels, device)
    except ValueError:
        raise UsageError(f"--kernels must be one of {', '.join(BACKENDS)}, not {options.kernels!r}") from None
    except RuntimeError as exc:
        raise UsageError(f"--kernels {options.kernels}: {exc}") from None


def load_decode_target(target: str, options: DecodeOptions):
    """(model, tokenizer, source) placed by the options, threads set for forwards of the batch's rows;
    with the Triton backend, tree attention runs through specdec's own attention function."""
    model, tokenizer, source = load_target(target, options.placement, rows=options.batch_size)
    if kernel_backend(options, input_device(model)) == "triton":
        from specdec.kernels.tree_attention import register

        model.set_attn_implementation(register())
    return model, tokenizer, source


def _build_draft(path: Path | str, target, tokenizer, options: DecodeOptions):
    """A draft model from an artifact folder or a hub id, checked against the target's tokenizer."""
    local = Path(path).is_dir()
    cfg = read_config(path) if local else load_model_config(str(path), options.placement).to_dict()
    expected = cfg.get("specdec_target")
    actual = tokenizer_fingerprint(tokenizer)
    if expected:
        check_fingerprint(expected, actual, f"draft {path}")
    elif not local or (Path(path) / "tokenizer.json").exists() or (Path(path) / "tokenizer_config.json").exists():
        check_fingerprint(tokenizer_fingerprint(load_tokenizer(str(path), options.placement)), actual, f"draft {path}")
    # a matching tokenizer does not make the embedding tables match: a draft with fewer rows would
    # index past its vocabulary on the target's tokens
    from specdec.models import vocab as draft_vocab

    reduced = draft_vocab.load(path) if local else None
    if reduced is not None and reduced.target_vocab != target.config.vocab_size:
        raise SpecdecError(f"draft {path} maps its vocabulary to one of {reduced.target_vocab} tokens; the target has {target.config.vocab_size}")
    if reduced is None and cfg.get("vocab_size") is not None and cfg.get("vocab_size") != target.config.vocab_size:
        raise SpecdecError(
            f"draft {path} has vocabulary size {cfg.get('vocab_size')}, the target's is {target.config.vocab_size}"
        )
    model = load_draft(path, options.placement, device=input_device(target), dtype=target.dtype)
    if reduced is not None:  # a reduced vocabulary's draft: target ids in, logits over the target's vocabulary out
        model = draft_vocab.MappedVocabLM(model, reduced)
    if options.verify not in ("standard", *TREE_SCHEMES):
        raise UsageError(f"verify must be one of standard, {', '.join(TREE_SCHEMES)}; not {options.verify!r}")
    if options.retrieval:  # RASD: the draft's chain fused with retrieval drafts (decode/drafters/retrieval.py)
        if options.acceptance or options.online or options.verify != "standard":
            raise UsageError("--retrieval fuses a retrieval tree with the draft's greedy chain: it does not combine with --acceptance, online=1 or verify=rsd|spectr")
        return retrieval.RasdDrafter(model, retrieval.open_datastore(options.retrieval, tokenizer))
    if options.acceptance:
        if options.online:
            raise UsageError("online=1 trains a plain draft model: it does not combine with --acceptance")
        if options.verify != "standard":
            raise UsageError("--acceptance drafts a chain: it does not combine with verify=rsd or spectr")
        return build_adaptive(resolve_member(options.acceptance), model, options, tokenizer=tokenizer)
    # two siblings per step unless --top-k says otherwise: each level of siblings costs the target a
    # wider forward, not the draft another call
    width = options.top_k or 2
    if options.parallel:  # PEARL: drafts while the target verifies (decode/drafters/pearl.py)
        from specdec.decode.drafters.pearl import ParallelDrafter

        return ParallelDrafter(model, pre_verify=options.pre_verify)
    if options.online:  # the draft learns from the job's own verification rounds (decode/drafters/online.py)
        from specdec.decode.drafters.online import OnlineDrafter

        return OnlineDrafter(model, every=options.online_every, scheme=options.verify, width=width)
    return draft_model.ModelDrafter(model, scheme=options.verify, width=width)


# kind (config.json "specdec_kind"/"kind") -> factory(path, target, tokenizer, options)
DRAFTER_KINDS: dict[str, Callable] = {
    "draft": _build_draft,
    "medusa": build_head_drafter,
    "clover": build_head_drafter,
    "eagle": build_head_drafter,
}


HEAD_KINDS = ("medusa", "clover", "eagle")


def _refuse_options_that_do_not_apply(kind: str, options: DecodeOptions) -> None:
    """Options of one drafter family given with another are refused, not silently ignored."""
    if kind not in HEAD_KINDS and (options.tree is not None or options.tree_tokens is not None):
        raise UsageError(f"--tree and --tree-tokens apply to medusa, clover and eagle drafters, not to {kind}")
    if kind != "draft" and options.acceptance:
        raise UsageError(f"--acceptance applies to draft models, not to a {kind} drafter")
    if kind != "draft" and options.retrieval:
        raise UsageError(f"--retrieval applies to draft models, not to a {kind} drafter (use retrieval:INDEX alone)")
    if kind != "draft" and options.online:
        raise UsageError(f"online updates apply to draft models, not to a {kind} drafter")
    if kind != "draft" and options.parallel:
        raise UsageError(f"--parallel (PEARL) applies to draft models, not to a {kind} drafter")
    if options.pre_verify and not options.parallel:
        raise UsageError("--pre-verify is PEARL's: it applies with --parallel")
    if options.parallel and (options.acceptance or options.online or options.verify != "standard"):
        raise UsageError("--parallel drafts a plain chain: it does not combine with --acceptance, online=1 or --verify rsd|spectr")
    if kind != "draft" and options.verify != "standard":
        raise UsageError(f"--verify {options.verify} applies to draft models, not to a {kind} drafter")
    if not options.acceptance and any(v is not None for v in (options.stop_threshold, options.min_draft, options.max_draft)):
        raise UsageError("--stop-threshold, --min-draft and --max-draft apply with --acceptance (adaptive draft length)")


def drafter_kind(spec: str) -> str:
    """The kind a drafter spec names (a model-free name, or the kind its artifact's config.json says)."""
    name, _, _ = spec.partition(":")
    if name in MODEL_FREE:
        return name
    return "draft" if _hub_id(spec) else artifact_kind(resolve_member(spec))


def _hub_id(spec: str) -> str | None:
    """``spec`` as a hub id of a draft model, when it names no folder and no default-family member."""
    if Path(spec).exists() or spec in FAMILY_MEMBERS:
        return None
    source = resolve_source(spec)  # raises for what is neither
    return None if Path(source).is_dir() else source


def check_drafter_options(spec: str, options: DecodeOptions) -> None:
    """Refuse options that do not apply to the drafter, before any model loads."""
    _refuse_options_that_do_not_apply(drafter_kind(spec), options)


def build_drafter(spec: str, target, tokenizer, options: DecodeOptions):
    name, _, _ = spec.partition(":")
    if name in MODEL_FREE_DRAFTERS:
        _refuse_options_that_do_not_apply(name, options)
        return MODEL_FREE_DRAFTERS[name](spec, target, tokenizer, options)
    hub = _hub_id(spec)
    if hub:  # a draft model on the hub (resolved offline from its cache with HF_HUB_OFFLINE=1)
        _refuse_options_that_do_not_apply("draft", options)
        return _build_draft(hub, target, tokenizer, options)
    path = resolve_member(spec)
    kind = artifact_kind(path)
    if kind not in DRAFTER_KINDS:
        raise SpecdecError(f"{path}: artifact kind {kind!r} is not a drafter (known: {', '.join(DRAFTER_KINDS)})")
    _refuse_options_that_do_not_apply(kind, options)
    return DRAFTER_KINDS[kind](path, target, tokenizer, options)
