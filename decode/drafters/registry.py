"""The registry of drafter kinds: which drafter a spec names, what builds it, and what it takes.

A drafter spec is a name that needs no artifact (``ar``, ``ngram``, ``recycle``, ``layerskip[:i,j]``, ``trimmed``,
``retrieval:INDEX``: ``NAMED_DRAFTERS``), a default family member (``draft``, ``medusa``, ...), an artifact
folder or a hub id (``ORG/NAME``) of a draft model; an artifact's ``config.json`` says its kind
(``specdec_kind`` or ``kind``), and ``DRAFTER_KINDS`` maps the kind to its factory. The CLI never branches
on names.

Each factory also declares the method's traits, which validation (``decode.jobs.validate``) and the bench
read instead of lists of names: ``model_free`` (drafting runs no model), ``approximate`` (the output may
differ from the target's own decoding), ``several_at_greedy`` (its --num-samples outputs differ at T = 0) and
``in_target`` (it drafts with the target's own layers in the target's cache).

Each factory declares the drafting options it takes (``Factory.takes``, ``DraftingOptions`` field names;
``num_draft`` goes to every drafter). A draft model is built in one of several modes, each a factory
selected by its switch option (``--acceptance``, ``--parallel``, ``online=1``, ``--retrieval``; none: a
plain chain). That an option does not apply to a drafter, or does not combine with a mode, is derived
from these declarations (``check_drafter_options``), before any model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdec.decode.drafters import aded, base, copying, draft_model, long_draft, model_free, retrieval, stand, suffix, trimmed
from specdec.decode.drafters import self_speculation as swift
from specdec.decode.drafters.adaptive import build_adaptive
from specdec.decode.drafters.heads import build_head_drafter
from specdec.decode.options import DecodeOptions, DraftingOptions, flag
from specdec.models.artifacts import FAMILY_MEMBERS, artifact_kind, check_fingerprint, read_config, resolve_member, tokenizer_fingerprint
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.loading import input_device, load_draft, load_model_config, load_tokenizer, resolve_source

COMMON = frozenset({"drafter", "num_draft"})  # options every drafter takes


@dataclass(frozen=True)
class Factory:
    """How one kind of drafter is built: ``build(source, target, tokenizer, options)`` (for a draft
    model's mode: ``build(model, tokenizer, options)``), the drafting options it ``takes`` beside
    ``num_draft``, its ``label`` in messages, a ``check`` of what follows ``name:`` in its spec (before
    any model loads), for a mode of a draft model the ``switch`` option that selects it, and the
    method's traits."""

    build: Callable
    takes: frozenset = frozenset()
    label: str = ""
    check: Callable[[str], None] | None = None
    switch: str | None = None
    modes: tuple = ()  # a kind built in modes: the modes' factories (the first, without a switch, is the default)
    # drafts without running any model (lookups in the text or in tables, or no drafts): a round's drafting
    # costs no forward, so the bench's ideal speedup charges it none
    model_free: bool = False
    # its output may differ from the target's own decoding (decode.approx, with a loop of its own): it decodes
    # greedily, batches by --batch-size, and its records say "approximate": true
    approximate: bool = False
    several_at_greedy: bool = False  # its --num-samples outputs differ at T = 0 (superposed decoding's k best drafts)
    # drafts with the target's own layers in the target's cache (``trimmed``): its rounds verify with the output layer
    # alone, so the bench's model of a round (one verify forward of the chain's width) does not describe it
    in_target: bool = False
    # a draft model's mode that takes the whole sorted (S2D) draft and the target, choosing depths itself, rather
    # than the sub-model of the target's depth
    whole_sorted_draft: bool = False

    def __call__(self, *args):
        return self.build(*args)

    def mode(self, drafting: DraftingOptions) -> "Factory":
        """The factory the options select: the mode whose switch is given (one at most), else the default."""
        if not self.modes:
            return self
        on = [m for m in self.modes if m.switch and _given(drafting, m.switch)]
        if len(on) > 1:
            raise UsageError(f"{flag(on[1].switch)} does not combine with {flag(on[0].switch)}: "
                             f"{on[0].label} and {on[1].label} are different ways to draft")
        return on[0] if on else self.modes[0]


def _given(drafting: DraftingOptions, name: str) -> bool:
    return getattr(drafting, name) != getattr(DraftingOptions(), name)


def _trimmed(spec: str, target, tokenizer, options: DecodeOptions):
    lookup = options.drafting.lookup
    if lookup not in (None, "ngram"):
        raise UsageError(f"the trimmed drafter feeds n-gram lookup's guesses only: --lookup ngram, not {lookup}")
    if input_device(target).type != "cpu":
        # a GPU reads a wide output layer about as fast as a narrow one: the draft would cost what a step costs
        raise UsageError("the trimmed drafter drafts on a CPU, where the output layer is a large share of a step; "
                         f"this target is on {input_device(target)}")
    found = NAMED_DRAFTERS[lookup](lookup, target, tokenizer, options) if lookup else None
    return trimmed.build_trimmed(spec, target, tokenizer, found)


def _layerskip(spec: str, target, tokenizer, options: DecodeOptions):
    skip = swift.parse_layerskip(spec, target.config.num_hidden_layers) or swift.search_layerskip(target, tokenizer)
    return draft_model.ModelDrafter(swift.layer_skip_view(target, skip))


# the approximate modes (decode.approx) are imported when first built or checked: they are loops of their own
# that most decodes never load
def _superposed(spec, target, tokenizer, options: DecodeOptions):
    from specdec.decode.approx import superposed

    return superposed.build(spec, target, tokenizer, options)


def _check_superposed(spec: str) -> None:
    from specdec.decode.approx import superposed

    superposed.check_spec(spec)


def _skipdecode(spec, target, tokenizer, options: DecodeOptions):
    from specdec.decode.approx import skipdecode

    return skipdecode.build(spec, target, tokenizer, options)


def _check_skipdecode(spec: str) -> None:
    from specdec.decode.approx import skipdecode

    skipdecode.check_spec(spec)


def ead_draft(spec: str) -> "DrafterChoice":
    """The draft model ``ead:DRAFT`` names (an artifact folder, a default-family member or a hub id),
    resolved as every drafter spec is, without loading anything; a ``UsageError`` when it names none or
    something that is not a draft model."""
    _, _, draft = spec.partition(":")
    draft = draft.strip()
    if not draft:
        raise UsageError("ead:DRAFT names the draft model that generates while it is sure (an artifact folder, "
                         "a default-family member such as draft, or a hub id): none given")
    if draft.partition(":")[0] in NAMED_DRAFTERS:
        raise UsageError(f"{spec!r}: EAD's DRAFT is a draft model, not the {draft.partition(':')[0]!r} drafter")
    choice = resolve_drafter(draft)
    if choice.kind != "draft":
        raise UsageError(f"{spec!r}: {draft} is a {choice.kind} artifact; EAD's DRAFT is a draft model (a small causal LM)")
    return choice


def _ead(spec, target, tokenizer, options: DecodeOptions):
    """Entropy Adaptive Decoding over the draft ``ead:DRAFT`` names, loaded and checked as draft models are."""
    from specdec.decode.approx.ead import EadDecoder

    draft = load_checked_draft(ead_draft(spec).source, target, tokenizer, options)
    drafting = options.drafting
    return EadDecoder(target, tokenizer, options, draft, threshold=drafting.entropy_threshold, window=drafting.entropy_window)


def _lud(path, target, tokenizer, options: DecodeOptions):
    from specdec.decode.approx import lud

    return lud.build(path, target, tokenizer, options)


# drafters a name selects, with no artifact: name -> factory(spec, target, tokenizer, options), as DRAFTER_KINDS'
# factories (the self-speculative ones draft with the target's own layers: a name, but not model-free)
NAMED_DRAFTERS: dict[str, Factory] = {
    "ar": Factory(lambda spec, target, tokenizer, options: base.NoDrafter(), label="ar (plain decoding)", model_free=True),
    "ngram": Factory(lambda spec, target, tokenizer, options: model_free.NgramDrafter(max_ngram=options.drafting.max_ngram),
                     frozenset({"max_ngram"}), "the ngram drafter", model_free=True),
    "recycle": Factory(lambda spec, target, tokenizer, options: model_free.RecycleDrafter(), label="the recycle drafter", model_free=True),
    "layerskip": Factory(_layerskip, label="layerskip", check=swift.check_layerskip_spec),
    "trimmed": Factory(_trimmed, frozenset({"lookup", "max_ngram"}), "the trimmed drafter",
                       check=trimmed.check_trimmed_spec, in_target=True),
    "copy": Factory(lambda spec, target, tokenizer, options: copying.CopyDrafter(), label="the copy drafter", model_free=True),
    "input-copy": Factory(lambda spec, target, tokenizer, options: copying.InputCopyDrafter(), label="the input-copy drafter",
                          model_free=True),
    "swift": Factory(swift.build_swift, label="swift", check=swift.check_swift_spec),
    "aded": Factory(lambda spec, target, tokenizer, options: aded.AdedDrafter(), label="the aded drafter", model_free=True),
    "stand": Factory(lambda spec, target, tokenizer, options: stand.StandDrafter(), label="the stand drafter", model_free=True),
    "suffix": Factory(suffix.build_suffix, frozenset({"suffix_cache"}), "the suffix drafter", model_free=True),
    "retrieval": Factory(retrieval.build_retrieval, label="retrieval:INDEX", check=retrieval.check_retrieval_spec, model_free=True),
    # approximate modes with a loop of their own (decode.engine.own)
    "superposed": Factory(_superposed, frozenset({"ngram_weight", "max_ngram"}), "superposed decoding", check=_check_superposed,
                          approximate=True, several_at_greedy=True),
    "ead": Factory(_ead, frozenset({"entropy_threshold", "entropy_window"}), "ead:DRAFT", check=lambda spec: ead_draft(spec) and None,
                   approximate=True),
    "skipdecode": Factory(_skipdecode, label="skipdecode[:FIRST,LAST]", check=_check_skipdecode, approximate=True),
}
NAMED = tuple(NAMED_DRAFTERS)


def _build_draft(path: Path | str, target, tokenizer, options: DecodeOptions):
    """A draft model from an artifact folder or a hub id, checked against the target's tokenizer, drafting
    in the mode the options select (``DRAFT_MODES``). A sorted (S2D) draft runs as the sub-model of the depth
    its config records for this target (``draft_model.s2d_view``), or with ``--exit-threshold`` at a depth
    chosen per draft step (``draft_model.SortedExitDrafter``). A draft with a tokenizer of its own drafts
    re-tokenised chains (``bridge.TokenizerBridgeDrafter``)."""
    foreign = _foreign_tokenizer(path, tokenizer, options)
    if foreign is not None:
        return _bridge(path, foreign, target, tokenizer, options)
    model = load_checked_draft(path, target, tokenizer, options, tokenizer_checked=True)
    factory = DRAFTER_KINDS["draft"].mode(options.drafting)
    if factory.whole_sorted_draft:
        return factory(model, tokenizer, options, target)
    model, _ = draft_model.s2d_view(model, getattr(getattr(model, "config", None), "specdec_s2d", None), target)
    return factory(model, tokenizer, options)


def _brings_tokenizer(path: Path | str) -> bool:
    """Whether a draft comes with a tokenizer of its own: a hub id does, a folder where it saved one."""
    folder = Path(path)
    return not folder.is_dir() or (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()


def _foreign_tokenizer(path: Path | str, tokenizer, options: DecodeOptions):
    """The draft's own tokenizer where it has one and it is not the target's; None otherwise (a draft
    without a tokenizer is checked against the target it records, in ``load_checked_draft``)."""
    if not _brings_tokenizer(path):
        return None
    own = load_tokenizer(str(path), options.placement)
    return None if tokenizer_fingerprint(own) == tokenizer_fingerprint(tokenizer) else own


def _bridge(path, draft_tokenizer, target, tokenizer, options: DecodeOptions):
    """A draft of another tokenizer: plain greedy chains, re-tokenised into the target's tokens."""
    from specdec.decode.drafters.bridge import TokenizerBridgeDrafter
    from specdec.decode.engine.types import Scheme

    mode = DRAFTER_KINDS["draft"].mode(options.drafting)
    if mode.switch is not None or Scheme(options.drafting.verify) != Scheme.standard:
        what = mode.label if mode.switch is not None else f"--verify {Scheme(options.drafting.verify).value}"
        raise UsageError(f"draft {path} has a tokenizer of its own: it drafts plain chains re-tokenised into the "
                         f"target's tokens, which {what} does not take")
    model = load_draft(path, options.placement, device=input_device(target), dtype=target.dtype)
    return TokenizerBridgeDrafter(model, draft_tokenizer, tokenizer)


def load_checked_draft(path: Path | str, target, tokenizer, options: DecodeOptions, tokenizer_checked: bool = False):
    """The draft model of an artifact folder or a hub id, loaded beside ``target`` (its input device and
    dtype) once its tokenizer fingerprint and vocabulary are checked against the target's; a reduced
    vocabulary's draft comes wrapped (``MappedVocabLM``: target ids in, logits over the target's
    vocabulary out). Draft models' drafters and EAD's draft (``decode.approx.ead``) load it here.
    ``tokenizer_checked``: the caller has compared the tokenizer the draft brings (``_foreign_tokenizer``)."""
    local = Path(path).is_dir()
    cfg = read_config(path) if local else load_model_config(str(path), options.placement).to_dict()
    expected = cfg.get("specdec_target")
    actual = tokenizer_fingerprint(tokenizer)
    if expected:
        check_fingerprint(expected, actual, f"draft {path}")
    elif not tokenizer_checked and _brings_tokenizer(path):
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
    return model


def _chain(model, tokenizer, options: DecodeOptions):
    # two siblings per step unless --top-k says otherwise: each level of siblings costs the target a
    # wider forward, not the draft another call
    drafting = options.drafting
    long = long_draft.long_context(model)
    if long is not None:  # LongSpec: the draft's cache keeps its sinks and window (decode.drafters.long_draft)
        return long_draft.LongDrafter(model, long["window"], long["sinks"], scheme=drafting.verify, width=drafting.top_k or 2)
    return draft_model.ModelDrafter(model, scheme=drafting.verify, width=drafting.top_k or 2)


def _sorted_exit(model, tokenizer, options: DecodeOptions, target):
    """S2D's depth per draft step (``draft_model.SortedExitDrafter``): ``model`` is the whole sorted draft."""
    return draft_model.SortedExitDrafter.from_sorted(model, target, options.drafting.exit_threshold)


def _online(model, tokenizer, options: DecodeOptions):
    """The draft learns from the job's own verification rounds (decode.drafters.online)."""
    from specdec.decode.drafters.online import OnlineDrafter

    drafting = options.drafting
    return OnlineDrafter(model, every=drafting.online_every, scheme=drafting.verify, width=drafting.top_k or 2)


def _adaptive(model, tokenizer, options: DecodeOptions):
    """SpecDec++: acceptance heads stop each row's chain (decode.drafters.adaptive)."""
    return build_adaptive(resolve_member(options.drafting.acceptance), model, options.drafting, tokenizer=tokenizer)


def _parallel(model, tokenizer, options: DecodeOptions):
    """PEARL: drafts while the target verifies (decode.drafters.pearl)."""
    from specdec.decode.drafters.pearl import ParallelDrafter

    return ParallelDrafter(model, pre_verify=options.drafting.pre_verify)


def _rasd(model, tokenizer, options: DecodeOptions):
    """RASD: the draft's chain fused with retrieval drafts (decode.drafters.retrieval)."""
    return retrieval.RasdDrafter(model, retrieval.open_datastore(options.drafting.retrieval, tokenizer))


DRAFT_MODES = (
    Factory(_chain, frozenset({"verify", "top_k"}), "draft models"),
    Factory(_online, frozenset({"online", "online_every", "verify", "top_k"}), "online draft models", switch="online"),
    Factory(_adaptive, frozenset({"acceptance", "stop_threshold", "min_draft", "max_draft"}),
            "adaptive draft length (SpecDec++, a chain)", switch="acceptance"),
    Factory(_parallel, frozenset({"parallel", "pre_verify"}), "PEARL (a plain chain)", switch="parallel"),
    Factory(_rasd, frozenset({"retrieval"}), "RASD (a retrieval tree fused with the draft's greedy chain)", switch="retrieval"),
    Factory(_sorted_exit, frozenset({"exit_threshold"}), "S2D's depth per step (a sorted draft's chain)", switch="exit_threshold",
            whole_sorted_draft=True),
)

HEAD_OPTIONS = frozenset({"tree", "tree_tokens", "top_k"})
# heads whose trees take a lookup's chains (--lookup; its own options with it, checked in decode.jobs.validate)
TREE_HEAD_OPTIONS = HEAD_OPTIONS | {"lookup", "max_ngram", "suffix_cache", "draft_weights"}


def _heads(path, target, tokenizer, options: DecodeOptions):
    heads = build_head_drafter(path, target, tokenizer, options.drafting)
    lookup = options.drafting.lookup
    if not lookup:
        return heads
    from specdec.decode.drafters.hybrid import LookupTree

    return LookupTree(heads, NAMED_DRAFTERS[lookup](lookup, target, tokenizer, options))


def _riding(path, target, tokenizer, options: DecodeOptions):
    """PPD / Hidden Transfer: drafts predicted at positions riding the verify forward (decode.drafters.parallel_prompts)."""
    from specdec.decode.drafters.parallel_prompts import build_riding_drafter

    return build_riding_drafter(path, target, tokenizer, options.drafting)


# kind (config.json "specdec_kind"/"kind") -> factory(path, target, tokenizer, options)
DRAFTER_KINDS: dict[str, Factory] = {
    "draft": Factory(_build_draft, label="draft models", modes=DRAFT_MODES),
    "medusa": Factory(_heads, TREE_HEAD_OPTIONS, "medusa heads"),
    "clover": Factory(_heads, TREE_HEAD_OPTIONS, "clover heads"),
    "eagle": Factory(_heads, TREE_HEAD_OPTIONS, "eagle heads"),
    "chimera": Factory(_heads, TREE_HEAD_OPTIONS, "chimera heads"),
    "block": Factory(_heads, TREE_HEAD_OPTIONS, "block drafters"),
    # their drafts ride the target's verify forward: a chain, or a sparse tree with a riding chain per node
    "ppd": Factory(_riding, HEAD_OPTIONS, "ppd prompt tokens"),
    "hidden-transfer": Factory(_riding, HEAD_OPTIONS, "hidden-transfer maps"),
    # Lexical Unit Decoding: the target fine-tuned by specdec train-lud (approximate)
    "lud": Factory(_lud, frozenset({"unit_threshold"}), "lud artifacts", approximate=True),
}


def _factories() -> list[tuple[Factory, Factory]]:
    """(kind's factory, mode) for every factory there is."""
    return [(k, m) for k in (*NAMED_DRAFTERS.values(), *DRAFTER_KINDS.values()) for m in (k.modes or (k,))]


def _where(name: str) -> str:
    """Where an option applies, by the factories that take it: ``draft models``, ``draft models with
    --acceptance``, ``medusa heads, clover heads and eagle heads``."""
    places = []
    for kind, mode in _factories():
        if name in mode.takes:
            places.append((kind.label, None if not kind.modes or mode.switch in (None, name) else flag(mode.switch)))
    texts = []
    for label, switch in places:
        text = label if switch is None else f"{label} with {switch}"
        if (switch is None or (label, None) not in places) and text not in texts:
            texts.append(text)
    return texts[0] if len(texts) == 1 else f"{', '.join(texts[:-1])} and {texts[-1]}"


def refuse_what_does_not_apply(kind: Factory, drafting: DraftingOptions) -> Factory:
    """The factory that builds the drafter of ``kind`` with these options; a drafting option given that it
    does not take is a ``UsageError`` saying where the option applies."""
    mode = kind.mode(drafting)
    for f in dataclasses.fields(drafting):
        name = f.name
        if name in COMMON or name in mode.takes or not _given(drafting, name):
            continue
        others = [m for m in kind.modes if name in m.takes]
        if others and mode.switch:
            raise UsageError(f"{flag(name)} does not combine with {flag(mode.switch)}: {mode.label} takes "
                             f"{', '.join(flag(n) for n in sorted(mode.takes - {mode.switch})) or 'no other option'}")
        if others:
            raise UsageError(f"{flag(name)} applies with {' or '.join(flag(m.switch) for m in others)}")
        raise UsageError(f"{flag(name)} applies to {_where(name)}, not to {kind.label}")
    return mode


@dataclass(frozen=True)
class DrafterChoice:
    """A drafter spec resolved: its ``kind``, the ``source`` its factory builds from (the spec of a
    named drafter, an artifact folder or a hub id) and the ``factory`` (its traits). ``build`` makes the drafter."""

    spec: str
    kind: str
    source: str | Path
    factory: Factory

    def build(self, target, tokenizer, options: DecodeOptions):
        return self.factory(self.source, target, tokenizer, options)


def resolve_drafter(spec: str) -> DrafterChoice:
    """Which drafter ``spec`` names, without loading anything; a spec that names none is a ``UsageError``."""
    name, _, _ = spec.partition(":")
    if name in NAMED_DRAFTERS:
        factory = NAMED_DRAFTERS[name]
        if factory.check is not None:
            factory.check(spec)
        return DrafterChoice(spec, name, spec, factory)
    hub = _hub_id(spec)
    if hub:  # a draft model on the hub (resolved offline from its cache with HF_HUB_OFFLINE=1)
        return DrafterChoice(spec, "draft", hub, DRAFTER_KINDS["draft"])
    path = resolve_member(spec)
    kind = artifact_kind(path)
    if kind not in DRAFTER_KINDS:
        raise SpecdecError(f"{path}: artifact kind {kind!r} is not a drafter (known: {', '.join(DRAFTER_KINDS)})")
    return DrafterChoice(spec, kind, path, DRAFTER_KINDS[kind])


def drafter_kind(spec: str) -> str:
    """The kind a drafter spec names (a named drafter's name, or the kind its artifact's config.json says)."""
    name, _, _ = spec.partition(":")
    if name in NAMED:
        return name
    return "draft" if _hub_id(spec) else artifact_kind(resolve_member(spec))


def named_factory(spec: str) -> Factory | None:
    """The factory of the drafter a spec names by name (``ngram``, ``retrieval:INDEX``), whose traits can be
    read without resolving anything; None for an artifact, a family member or a hub id."""
    return NAMED_DRAFTERS.get(spec.partition(":")[0])


def _hub_id(spec: str) -> str | None:
    """``spec`` as a hub id of a draft model, when it names no folder and no default-family member. A
    name without a slash is a hub id only when the local hub cache holds it: otherwise it names nothing
    (a typo is a usage error here, not a download attempt after the target loaded)."""
    if Path(spec).exists() or spec in FAMILY_MEMBERS:
        return None
    source = resolve_source(spec)  # raises for what is neither
    if Path(source).is_dir():
        return None
    if "/" not in source and not _in_hub_cache(source):
        raise UsageError(f"{spec!r} names no drafter: not one of {', '.join(NAMED)}, a default-family member "
                         f"({', '.join(FAMILY_MEMBERS)}), an artifact folder or a hub id (ORG/NAME)")
    return source


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def check_drafter_options(spec: str, options: DecodeOptions) -> DrafterChoice:
    """The drafter ``spec`` names, with the drafting options refused that its factory does not take;
    nothing loads. ``DrafterChoice.build`` then builds it."""
    choice = resolve_drafter(spec)
    refuse_what_does_not_apply(choice.factory, options.drafting)
    return choice


def build_drafter(spec: str, target, tokenizer, options: DecodeOptions):
    """The drafter ``spec`` names, built with ``options`` (checked first, as ``check_drafter_options``)."""
    return check_drafter_options(spec, options).build(target, tokenizer, options)
