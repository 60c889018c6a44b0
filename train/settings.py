"""What each trainer trains, declared once: a settings dataclass per trainer, each field with its range or
choices and its help (``decode.options.opt``, the same declarations decode's options use).

A trainer takes its settings (and single settings by name on top of them); its command's flags are made
from the fields that carry help (``cli.options.declared_flags``, each defaulting to unset so a recipe's
value stands unless a flag is given); a recipe section's keys are the same names; ``check`` refuses out of
range values and impossible combinations before any model loads. This module imports nothing heavy, so
the command line can read the declarations without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.decode.options import POSITIVE, Range, field_refusal, opt
from specdec.models.errors import UsageError

KD_WEIGHT = 0.9  # the share of the distillation term in a draft's loss (the rest: cross-entropy)


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
