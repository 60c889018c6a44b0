"""What each trainer trains, declared once: a settings dataclass per trainer, each field with its range or
choices and its help (``decode.options.opt``, the same declarations decode's options use).

A trainer takes its settings (and single settings by name on top of them); its command's flags are made
from the fields that carry help (``cli.options.declared_flags``, each defaulting to unset so a recipe's
value stands unless a flag is given); a recipe section's keys are the same names; ``check`` refuses out of
range values and impossible combinations before any model loads. This module imports nothing heavy, so
the command line can read the declarations without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from specdec.decode.options import AT_LEAST_ZERO, POSITIVE, Range, field_refusal, flag, opt
from specdec.models.errors import UsageError

KD_WEIGHT = 0.9  # the share of the distillation term in a draft's loss (the rest: cross-entropy)


def check_by_name(cls, source) -> None:
    """Refuse what the settings ``cls`` declare out of range among ``source``'s values of the same names (a trainer's
    own config, which the library can be handed directly): one declaration checks the flags and the config alike."""
    cls(**{f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}).check()


def _check_ranges(settings) -> None:
    refusal = field_refusal(settings)
    if refusal:
        raise UsageError(refusal)


@dataclass(frozen=True)
class DraftSettings:
    """What train-draft trains, beside the loop's ``TrainConfig``: each setting declared once (its range or
    choices and its help, ``decode.options.opt``). ``train-draft``'s flags are made from the declarations
    that carry help, a recipe section's keys are these names (``train.recipe.recipe_settings``), and
    ``check`` refuses what they rule out before any model loads."""

    init: str | None = opt(help="Start from this causal LM checkpoint (same vocabulary).")
    arch: str | None = opt(help="New small Llama: layers=N,hidden=N,heads=N[,kv_heads=N,ffn=N].")
    kd_weight: float = opt(KD_WEIGHT, range=Range(0, 1),
                           help="Weight of forward KL to the target (1-W goes to CE; 0 = CE only). Default: the recipe's.")
    temperature: float = opt(1.0, range=Range(0, open_lo=True), help="Distillation temperature. Default: the recipe's.")
    lora: bool = opt(False, help="Train a LoRA adapter on the --init draft.")
    lora_save: str = opt("merged", choices=("merged", "adapter"), help="merged (plain weights) or adapter (peft adapter folder).")
    lora_rank: int = opt(8, range=POSITIVE)
    cache_teacher: bool = opt(False, help="Compute the target's top-k logits once, on disk, inside the budget (default: the recipe's).")
    teacher_topk: int = opt(64, range=POSITIVE)
    ce_labels: str = opt("data", choices=("data", "target"), help="CE term's labels under KD: data (next tokens) or target "
                         "(the target's greedy tokens). Default: the recipe's.")
    # a reduced draft vocabulary (train.teacher.resolve_draft_vocab; None: by the target's size, 0: the whole)
    draft_vocab: int | None = None
    teacher_cache: str | None = None  # where the reduced-vocabulary teacher cache is kept (default: in the artifact)
    charge_teacher: bool = True  # the teacher cache's compute time comes out of --budget-minutes
    s2d_depths: tuple | None = None  # S2D: the draft depth of each target (default: by the targets' sizes)
    long_context: bool = opt(False, help="LongSpec: a draft whose cache keeps --sinks sink tokens and the last --window "
                             "tokens, trained at anchor-offset positions.")
    window: int = opt(256, range=POSITIVE, help="--long-context: the recent tokens the draft attends to (default 256).")
    sinks: int = opt(4, range=Range(0, integer=True), help="--long-context: the first tokens the draft always attends to (default 4).")

    def check(self, targets: int) -> None:
        """Refuse settings out of their declared ranges, and combinations that cannot be meant."""
        _check_ranges(self)
        if self.init and self.arch:
            raise UsageError("give --init or --arch, not both")
        if self.lora and not self.init:
            raise UsageError("--lora trains an adapter on an initialized draft: give --init DIR")
        if self.draft_vocab and (self.init or self.lora):
            raise UsageError("--draft-vocab builds a new draft over the reduced vocabulary: it does not combine with --init or --lora")
        if not targets:
            raise UsageError("give a target")
        if self.sorted(targets) and self.draft_vocab:
            raise UsageError("--targets (S2D) does not combine with --draft-vocab")

    def sorted(self, targets: int) -> bool:
        """An S2D draft: several targets, or depths given."""
        return targets > 1 or self.s2d_depths is not None


@dataclass(frozen=True)
class AcceptanceSettings:
    """What train-acceptance trains (SpecDec++'s acceptance heads), beside the loop's ``TrainConfig``."""

    num_layers: int = opt(3, range=POSITIVE)  # layers of each head's MLP
    reject_weight: float = opt(6.0, range=Range(0, open_lo=True), help="BCE weight of the reject class (sampling head).")
    target_token_frac: float = opt(0.15, range=Range(0, 1))  # sampling head: positions labelled on a token of the target's
    temperature: float = opt(1.0, range=Range(0, open_lo=True), help="Sampling temperature the sampling head and its "
                             "default policy are for (decode at it).")
    greedy_reject_weight: float = opt(1.0, range=Range(0, open_lo=True), help="BCE weight of the reject class (greedy head).")
    greedy_prefix: int = opt(64, range=POSITIVE)  # greedy head: prefix tokens of each continuation
    greedy_new_tokens: int = opt(128, range=POSITIVE)
    greedy_sequences: int = opt(1024, range=POSITIVE, help="Most greedy continuations of the target to label for the greedy head.")
    cost_new_tokens: int = opt(48, range=POSITIVE)  # tokens each round-cost timing decodes
    cost_reps: int | None = opt(range=POSITIVE)  # interleaved round-cost timings (None: 3, 1 under a small budget)
    policy_prompts: str | None = opt(help="Prompts JSONL like the ones you will decode: the greedy stop policy is chosen on "
                                     "real rounds over them (default: held-out training text).")

    def check(self) -> None:
        _check_ranges(self)


HEAD_KINDS = ("medusa", "clover", "eagle", "chimera", "block")  # heads on the target's hidden states (models.heads.KINDS)
RIDING_KINDS = ("ppd", "hidden-transfer")  # drafting positions riding the target's own forward (models.heads.RIDE_KINDS)
_NUMBERED = ("medusa", "clover", "chimera", "block", *RIDING_KINDS)  # a number of heads (EAGLE's one head drafts a chain)
_ATTENDING = ("clover", "chimera")  # heads with their own attention over the last tokens


def _of(kinds: tuple, default=None, **declared):
    """A setting of the head kinds ``kinds`` (its range, choices and help as ``opt`` declares them): a value
    other than its default, given for another kind, is refused (``HeadSettings.check``)."""
    declared = opt(default, **declared)
    return field(default=default, metadata={**declared.metadata, "kinds": kinds})


@dataclass(frozen=True)
class HeadSettings:
    """What train-heads trains, beside the loop's ``TrainConfig`` and the head kind: each setting declared once
    with the kinds it applies to. None: the kind's own default; any other declared default is the one
    ``models.head_artifacts.build_heads`` takes. ``train-heads``' flags are made from the declarations that
    carry help, a recipe section's keys are these names, and ``check`` refuses what they rule out before any
    model loads."""

    num_heads: int | None = _of(_NUMBERED, range=POSITIVE, help="Medusa/Clover/Chimera heads, a block drafter's block size "
                                "(tokens drafted per call) (default 4).")
    num_layers: int | None = _of(("medusa", "chimera", "block"), range=POSITIVE)  # layers of each head / the block draft (default 1)
    anchors: int | None = _of(("block",), range=POSITIVE, help="Block drafter: cut points trained per block of text (default 64).")
    loss: str = _of(("block",), "kl", choices=("kl", "lk"),
                    help="Block drafter: kl (soft cross-entropy to the target) or lk (plus the expected accepted length, as the LK losses).")
    # one output layer shared by the heads (default: with a reduced draft vocabulary, whose rows only the target has)
    shared_head: bool | None = _of(("medusa",))
    attn_heads: int | None = _of(_ATTENDING, range=POSITIVE)  # default: the target's attention heads
    window: int | None = _of(_ATTENDING, range=POSITIVE)  # the last tokens a head attends to (default 64)
    eagle3: bool = _of(("eagle",), False, help="EAGLE: multi-layer features and unrolled training-time steps.")
    unroll: int | None = _of(("eagle",), range=POSITIVE, help="EAGLE: unrolled training-time steps (1 = EAGLE-1).")
    fspad: bool = _of(("eagle",), False, help="EAGLE: FSPAD (feature sampling: the token's embedding gates the fused "
                      "feature; partial alignment: the feature loss covers only the first --fspad-align of its dimensions). "
                      "Recipe: fspad / fspad_align in the eagle section's extra.")
    fspad_align: float = _of(("eagle",), 0.5, range=Range(0, 1, open_lo=True),
                             help="FSPAD: the fraction of the predicted feature's dimensions regressed onto the target's, in "
                             "(0, 1] (default 0.5; implies --fspad).")
    ensemble: int = _of(("ppd",), 1, range=POSITIVE, help="PPD: prompt embeddings per future position, riding as chains "
                        "blind to each other, their logits averaged (default 1; recipe: ensemble in the ppd section's extra).")
    # the heads' reduced vocabulary (train.teacher.resolve_draft_vocab); its flag is the one train-draft shares (cli.options)
    draft_vocab: int | None = _of(HEAD_KINDS, range=AT_LEAST_ZERO)
    teacher_cache: str | None = _of(HEAD_KINDS, help="File for the target's features and top-k logits over the training "
                                    "blocks, computed once (used whenever --draft-vocab is given).")
    teacher_topk: int = _of(HEAD_KINDS, 32, range=POSITIVE)  # the target's logits the teacher cache keeps per position
    charge_teacher: bool = _of(HEAD_KINDS, True)  # the teacher cache's compute time comes out of --budget-minutes
    layout: str = _of(("eagle", "block"), "specdec", choices=("specdec", "published"),
                      help="EAGLE: published (EAGLE-1, or EAGLE-3 with --eagle3, as vLLM / SGLang / speculators run them: "
                      "exportable --to speculators|eagle; the default) or specdec (its own architecture; the default with "
                      "--fspad, which the published layouts cannot hold). Block drafter: published (DFlash's, as "
                      "speculators and vLLM run it: exportable --to speculators; the default) or specdec (queries fused "
                      "with the last context entry, learned mask and block positions).")
    mask_token_id: int | None = _of(("block",), range=AT_LEAST_ZERO,
                                    help="Block drafter, --layout published: the token whose embedding fills the block's "
                                    "drafting slots (default: the tokenizer's mask token, else its pad, else its unk token).")
    # EAGLE: the target layers whose hidden states are fused ("eagle3": EAGLE-3's three; default: the last, or EAGLE-3's)
    feature_layers: str | list | None = _of(("eagle", "block"))  # block: default EAGLE-3's three, "last" the last alone
    noise: float | None = _of(("eagle",), range=Range(0))  # feature noise in training (default 0.2; published EAGLE-3: 0)
    ce_weight: float | None = _of(("eagle",), range=Range(0))  # the token loss beside the feature loss (default 0.1)
    reg_weight: float | None = _of(("eagle",), range=Range(0))  # the feature regression loss (default 1)
    eval_depth: int = _of(("eagle",), 5, range=POSITIVE)  # the chain the held-out evaluation drafts
    # --layout published: the published architectures' variants (models.interop.build_published_eagle)
    fc_bias: bool = _of(("eagle",), True)
    own_embed: bool = _of(("eagle",), False)
    norm_before_residual: bool = _of(("eagle",), False)
    norm_before_fc: bool = _of(("eagle",), False)
    fc_norm: bool = _of(("eagle",), False)
    norm_output: bool = _of(("eagle",), False)
    logits_norm: bool = _of(("eagle",), True)
    init_from_lm_head: bool = _of(HEAD_KINDS, True)  # heads' output layers start as the target's (riding kinds: always)
    cuts: int | None = _of(RIDING_KINDS, range=POSITIVE)  # cut points per training block (default 16)
    placeholder: int | None = _of(RIDING_KINDS, range=AT_LEAST_ZERO)  # the riding positions' token id (default: chosen)
    layer: int | None = _of(("hidden-transfer",), range=AT_LEAST_ZERO)  # where the maps inject (default: round(2L/3))

    def check(self, kind: str) -> None:
        """Refuse an unknown kind, settings out of their declared ranges, a setting given for a kind it does not
        apply to, and combinations that cannot be meant."""
        if kind not in HEAD_KINDS + RIDING_KINDS:
            raise UsageError(f"--kind must be one of {', '.join(HEAD_KINDS + RIDING_KINDS)}, not {kind!r}")
        _check_ranges(self)
        for f in fields(self):
            if kind not in f.metadata["kinds"] and getattr(self, f.name) != f.default:
                raise UsageError(f"{flag(f.name)} applies to --kind {' / '.join(f.metadata['kinds'])}, not --kind {kind}")
        if self.fspad and self.layout == "published":
            raise UsageError("--fspad cannot train --layout published: the published EAGLE-1 / EAGLE-3 checkpoints (vLLM, "
                             "SGLang, speculators) have no place for FSPAD's feature sampler (an embedding-gated MLP after fc); "
                             "use --layout specdec")

    def hparams(self, kind: str) -> dict:
        """The head's hyper-parameters as ``build_heads`` reads them and the training config records them: the
        settings of ``kind`` that differ from their defaults (so ``layout`` only when published), the teacher's
        left out, and FSPAD's alignment exactly when FSPAD is on."""
        teacher = ("draft_vocab", "teacher_cache", "teacher_topk", "charge_teacher")
        hp = {f.name: getattr(self, f.name) for f in fields(self)
              if kind in f.metadata["kinds"] and f.name not in teacher and getattr(self, f.name) != f.default}
        if self.fspad:
            hp["fspad_align"] = self.fspad_align
        else:
            hp.pop("fspad_align", None)  # an aligned fraction means nothing without FSPAD
        return hp


@dataclass(frozen=True)
class LudSettings:
    """What train-lud trains (Lexical Unit Decoding: a LoRA on the target), beside the loop's ``TrainConfig``."""

    unit_size: int = opt(3, range=Range(2, integer=True, note=" (1 is ordinary decoding)"),
                         help="Tokens per lexical unit: the last real position and m-1 placeholders each predict one (default 3).")
    cuts: int = opt(16, range=POSITIVE, help="Cut points per training block: each starts a unit to predict (default 16).")
    lora_rank: int = opt(8, range=POSITIVE, help="Rank of the LoRA on the target's attention (default 8).")
    lora_alpha: float = opt(16.0, range=Range(0, open_lo=True), help="LoRA scale alpha (default 16).")
    ntp_weight: float = opt(1.0, range=Range(0), help="Weight of the ordinary next-token loss beside the unit loss (default 1; 0: units only).")
    placeholder_id: int | None = opt(range=AT_LEAST_ZERO, help="The placeholder positions' token id (default: one the tokenizer "
                                     "rarely uses, chosen).")

    def check(self) -> None:
        _check_ranges(self)


@dataclass(frozen=True)
class DllmSettings:
    """What train-dllm trains (a masked-diffusion LM from an AR checkpoint or a config, or dParallel's certainty
    forcing of a dLLM), beside the shared training options (``kwargs``: as ``train_dllm`` takes them)."""

    block_size: int = opt(32, range=POSITIVE, help="Block size of block diffusion (and of decoding).")
    attention: str = opt("block", choices=("block", "bidirectional"), help="block (block diffusion) or bidirectional.")
    list_tasks: int = opt(0, range=AT_LEAST_ZERO, help="Add this many generated list tasks (copy/reverse/sort) to the mix.")
    certainty_forcing: bool = opt(False, help="dParallel certainty-forcing distillation of --target (a dLLM).")
    lora: bool = opt(False, help="Train a LoRA (merged into the saved model).")
    cf_prompts: int = opt(256, range=POSITIVE, help="Certainty forcing: code prompts cut from --data whose own answers are distilled.")
    gen_length: int = opt(128, range=POSITIVE, help="Certainty forcing: answer length of the self-generated decodes "
                          "(decode at this length).")
    cf_cache: str = opt("none", choices=("none", "prefix"), help="Certainty forcing: cache of the self-generating static "
                        "decodes (none, or prefix: same result up to rounding under block attention, much faster).")

    def check(self) -> None:
        _check_ranges(self)

    def kwargs(self) -> dict:
        """``train_dllm``'s keywords (its ``DllmTrainConfig`` names the answer length ``cf_gen_length``); the list
        tasks are examples the command makes, not a trainer setting."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("gen_length", "list_tasks")}
        return values | {"cf_gen_length": self.gen_length}


@dataclass(frozen=True)
class FilterSettings:
    """What train-filter trains (a Learn2PD filter for a dLLM); the trainer's ``FilterTrainConfig`` takes them by name."""

    gen_length: int = opt(128, range=POSITIVE, help="Answer length of the labelling decodes.")
    block_size: int = opt(32, range=POSITIVE, help="Decode block size (the filter's width).")
    hidden: int = opt(0, range=AT_LEAST_ZERO, help="0: logistic regression; >0: MLP hidden size.")
    code_prompts: int = opt(0, range=AT_LEAST_ZERO, help="Cut this many code prompts (64-256 tokens, as the held-out prompts) "
                            "from --data's texts instead of using them as prompts.")
    cache: str = opt("none", choices=("none", "prefix"), help="Cache of the labelling decodes (none, or prefix: same result up "
                     "to rounding under block attention, much faster).")

    def check(self) -> None:
        _check_ranges(self)

    def kwargs(self) -> dict:
        """``train_filter``'s keywords (cutting code prompts is the command's, before it)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "code_prompts"}
