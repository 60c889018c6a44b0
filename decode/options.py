"""Decode options in five typed pieces, and method specs.

``DecodeOptions`` holds one piece per concern, each read by the code it concerns:

- ``sampling`` (``SamplingOptions``): what is generated: budget, temperature, top-p, seed, samples, stop strings;
- ``drafting`` (``DraftingOptions``): the drafter spec and what its factory takes (tree shape, draft
  length, verification scheme, acceptance heads, PEARL, online updates, retrieval); which of these
  options a drafter takes is declared by its factory (``decode.drafters.registry``);
- ``scheduling`` (``SchedulingOptions``): how rows run: batch size, static or continuous batching,
  prefill chunks, shared prefixes, a memory budget, compiled steps, kernels;
- ``placement`` (``PlacementOptions``, ``models.loading.Placement``): device, dtype, device map,
  attention, remote code, threads;
- ``diffusion`` (``DiffusionOptions``): what a masked-diffusion LM decodes with.

Every option has one name across the pieces: the field name, the ``specdec decode`` flag (dashes for
underscores) and the key of a method spec. ``DecodeOptions(batch_size=4, drafter="ngram")`` routes each
name to its piece. A method spec is a drafter followed by ``+key=value`` options, e.g. ``draft+k=4``,
``draft+acceptance=acceptance``, ``eagle+tree=dynamic+tree-tokens=32`` (``with_overrides``).

Nothing here checks values: ``decode.jobs.validate`` checks every option once, before any model loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

from specdec.decode.engine.types import Scheme
from specdec.models.errors import UsageError
from specdec.models.loading import Placement

@dataclass(frozen=True)
class Range:
    """An option's declared range, checked by ``decode.jobs.validate.check_declared`` before any model
    loads: integer or number, its ends (open or closed), whether infinity is a value, and what the ends
    mean (said in the refusal)."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    integer: bool = False
    infinite: bool = False  # float("inf") is a meaningful value (an entropy threshold: never switch)
    note: str = ""

    def refusal(self, value, name: str) -> str | None:
        """The one-line refusal of ``value`` for the option ``name`` (its flag), or None when it is in range."""
        if self.integer:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{name} must be an integer, got {value!r}"
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or (
                math.isinf(value) and not self.infinite):
            return f"{name} must be {self.text()}{self.note}, got {value}"
        low = self.lo is not None and (value < self.lo or (self.open_lo and value == self.lo))
        high = self.hi is not None and (value > self.hi or (self.open_hi and value == self.hi))
        return f"{name} must be {self.text()}{self.note}, got {value}" if low or high else None

    def text(self) -> str:
        lo, hi = (_shown(v) for v in (self.lo, self.hi))
        if self.integer:
            if self.hi is not None:
                return f"in {lo}..{hi}"
            return "a positive integer" if self.lo == 1 else f"an integer >= {lo}"
        if self.hi is not None:
            return f"in {'(' if self.open_lo else '['}{lo}, {hi}{')' if self.open_hi else ']'}"
        return f"{'a number' if self.infinite else 'a finite number'} {'>' if self.open_lo else '>='} {lo}"


def _shown(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def field_refusal(value) -> str | None:
    """The refusal of the first field of the dataclass ``value`` outside its declared range or choices
    (``opt``), in declaration order; None when every one is in (None, unset, always is)."""
    for f in dataclasses.fields(value):
        given, rng, choices = getattr(value, f.name), f.metadata.get("range"), f.metadata.get("choices")
        if given is None:
            continue
        refusal = rng.refusal(given, flag(f.name)) if rng is not None else None
        if refusal is None and choices and given not in choices:
            refusal = f"{flag(f.name)} must be one of {', '.join(choices)}, got {given!r}"
        if refusal is not None:
            return refusal
    return None


POSITIVE = Range(1, integer=True)
AT_LEAST_ZERO = Range(0, integer=True)


def opt(default=None, *, range: Range | None = None, choices: tuple | None = None, help: str | None = None,
        spec_only: bool = False, short: str | None = None, default_factory=None):
    """A declared option: its default, its ``range`` or ``choices`` (checked once, before any model loads),
    the ``help`` of its ``specdec decode`` flag (a drafting option with help gets its flag from this
    declaration, ``cli.options.declared_flags``; ``short`` is a one-letter alias), or ``spec_only``: set
    in method specs (``ngram+max-ngram=4``) and bench, with no flag."""
    meta = {"range": range, "choices": choices, "help": help, "spec_only": spec_only, "short": short}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


OPTION_ALIASES = {"k": "num_draft", "gamma": "num_draft"}
# how a job batches its records: auto = continuous for causal LMs, static for diffusion LMs
SCHEDULES = ("auto", "continuous", "static")


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = opt(128, range=POSITIVE)
    temperature: float = opt(0.0, range=Range(0, note=" (0 = greedy)"))
    top_p: float = opt(1.0, range=Range(0, 1, open_lo=True))
    seed: int = 0
    # samples per record (T > 0 only), decoded as rows of one job that drafters may share state between
    num_samples: int = opt(1, range=POSITIVE)
    stop: list = field(default_factory=list)
    # First Finish Search: launch N samples of a record and keep the first to finish (EOS or a stop
    # string); the others stop as soon as they can no longer finish first (decode.engine.loop)
    first_finish: int = opt(0, range=AT_LEAST_ZERO)
    # beam search (decode.engine.beams): B beams in G groups decoded in turn, a group's scores lowered by
    # diversity_penalty for each earlier group's beam that chose the same token at the step (Diverse Beam Search)
    beams: int = opt(1, range=POSITIVE)
    beam_groups: int = opt(1, range=Range(1, integer=True, note=" (groups of --beams)"))
    diversity_penalty: float = opt(0.0, range=Range(0))


AUTO = "auto"  # --drafter auto
MAX_NUM_DRAFT = 256  # drafted tokens per round; beyond this a round costs more than it can win
MAX_TOP_K = 16  # siblings per step / children per node
MAX_TREE_TOKENS = 1024


@dataclass(frozen=True)
class DraftingOptions:
    """The drafter spec and the options drafter factories take; ``num_draft`` applies to every drafter,
    the others to the drafters whose factory declares them (``decode.drafters.registry``). Each option
    is declared once here (``opt``): its range or choices, and the help its ``specdec decode`` flag
    shows; the flags are made from these declarations."""

    # "ar": plain decoding; ``specdec decode``'s default is AUTO, resolved per target before the job starts
    # (decode.jobs.validate.resolve_auto)
    drafter: str = "ar"
    num_draft: int | None = opt(range=Range(1, MAX_NUM_DRAFT, integer=True, note=" (--drafter ar decodes without drafting)"),
                                short="-k", help="Drafted tokens per round (tree depth for tree drafters).")
    # n-gram drafter: the longest suffix matched
    max_ngram: int = opt(3, range=POSITIVE, spec_only=True)
    # token trees of heads (None: the kind's default, dynamic for EAGLE, static for the others)
    tree: str | None = opt(choices=("static", "dynamic"), help="Tree drafters: static, or dynamic (EAGLE-2; EAGLE's default).")
    tree_tokens: int | None = opt(range=Range(1, MAX_TREE_TOKENS, integer=True), help="Tree drafters: nodes per tree.")
    # children per expanded node (static: per head/depth; dynamic: frontier width); siblings for rsd/spectr
    top_k: int | None = opt(range=Range(1, MAX_TOP_K, integer=True),
                            help="Siblings per step for --verify rsd|spectr; children per node for tree drafters.")
    # how a draft model's samples are verified: standard (a chain), rsd or spectr (a tree of --top-k
    # siblings per draft step; decode.engine.verify.verify_tree_drafted)
    verify: Scheme = opt(Scheme.standard, help="Draft models at T>0: standard (a chain), rsd (siblings sampled without "
                         "replacement, recursive rejection) or spectr (k i.i.d. chains, k-sequential selection); --top-k siblings.")
    # adaptive draft length (SpecDec++): an acceptance-head artifact; the stop policy's fields (None: the
    # artifact's default policy for the decode mode, decode.drafters.adaptive.resolve_policies)
    acceptance: str | None = opt(help="Acceptance-head artifact: adaptive draft length (SpecDec++).")
    stop_threshold: float | None = opt(range=Range(0, 1, open_lo=True, open_hi=True),
                                       help="Adaptive drafting stops when 1 - prod(P_accept) exceeds this (default: the artifact's policy).")
    min_draft: int | None = opt(range=AT_LEAST_ZERO, help="Adaptive drafting: fewest drafts per round; 0 lets a round draft nothing.")
    max_draft: int | None = opt(range=POSITIVE, help="Adaptive drafting: most drafts per round.")
    # online speculative decoding (decode.drafters.online): distil the draft model on the job's own rounds,
    # an update every online_every verification rounds
    online: bool = opt(False, spec_only=True)
    online_every: int = opt(8, range=POSITIVE, spec_only=True)
    # PEARL (decode.drafters.pearl): the draft model drafts the next block while the target verifies this one;
    # with pre_verify the target tests the first draft while the draft draws the rest
    parallel: bool = opt(False, help="Draft models: the draft drafts the next block while the target verifies this one "
                         "(PEARL; a thread or CUDA stream each).")
    pre_verify: bool = opt(False, help="With --parallel: the target tests the first draft while the draft draws the rest, "
                           "and a round whose first draft every row rejects ends there (PEARL's pre-verify; a second target "
                           "forward when it is accepted).")
    # RASD: a retrieval index (specdec index build) whose drafts are fused into a draft model's tree
    retrieval: str | None = opt(help="Retrieval index (specdec index build) fused into a draft model's tree (RASD).")
    # Entropy Adaptive Decoding (ead:DRAFT, approximate): the target generates while the mean entropy (nats)
    # of the draft's last entropy_window next-token distributions is above entropy_threshold
    entropy_threshold: float | None = opt(range=Range(0, infinite=True, note=" (nats; inf: never switch)"),
                                          help="ead:DRAFT (approximate): the target takes over while the draft's mean "
                                          "next-token entropy (nats) over the window is above this (0: always the target; inf: never).")
    entropy_window: int | None = opt(range=POSITIVE, help="ead:DRAFT: next-token distributions the rolling entropy averages.")
    # Lexical Unit Decoding (an lud artifact, approximate): a unit's tokens are emitted together while each
    # one's probability clears unit_threshold
    unit_threshold: float | None = opt(range=Range(0, 1, open_lo=True),
                                       help="lud artifacts (approximate): a lexical unit's tokens are emitted together while "
                                       "each one's probability is at least this.")
    # Superposed Decoding (approximate): the weight of the n-gram model (order max_ngram) interpolated
    # with the model's next-token probabilities when the drafts are scored
    ngram_weight: float | None = opt(range=Range(0, 1, open_hi=True),
                                     help="superposed (approximate): weight of the n-gram model over the job's prompts in the "
                                     "drafts' scores, in [0, 1).")
    # S2D (a sorted draft, train-draft --targets): the depth chosen per draft step: the shallowest recorded
    # sub-model drafts where its top probability is at least exit_threshold, the target's own depth elsewhere
    exit_threshold: float | None = opt(range=Range(0, 1, note=" (0: always the shallow sub-model, 1: always the deep one)"),
                                       help="A sorted (S2D) draft: its depth chosen per draft step: the shallowest sub-model's "
                                       "token where its top probability is at least this, else the sub-model of this target's depth.")
    # SuffixDecoding: a folder keeping finished texts across jobs (decode.drafters.suffix)
    suffix_cache: str | None = opt(help="--drafter suffix: a folder that keeps finished texts (prompt and output) across jobs, "
                                   "appended as rows finish; drafts from earlier jobs' outputs.")
    # a head drafter's own matrices on a CPU: Q8_0 blocks through the kernel (models.blocks.quantize_layers), or float32
    draft_weights: str | None = opt(choices=("q8_0", "float32"),
                                    help="Head drafters on a CPU: their layers' weights as Q8_0 blocks read by specdec's "
                                    "kernel (the default where it builds: a quarter of the bytes a draft call reads; the "
                                    "drafts may change, never the output) or float32.")
    # a model-free lookup (decode.drafters.hybrid.LOOKUPS) whose chains join a head drafter's trees
    lookup: str | None = opt(choices=("ngram", "suffix"),
                             help="Head drafters (EAGLE, Medusa, ...): ngram or suffix: the lookup's chains join the heads' "
                             "trees; a round whose lookup match is long drafts the lookup's chain alone.")


@dataclass(frozen=True)
class SchedulingOptions:
    batch_size: int = opt(8, range=POSITIVE)
    schedule: str = opt("auto", choices=SCHEDULES)
    # continuous batching: prompt tokens an admitted record prefills per round inside the verify forwards
    # (SARATHI); 0 prefills it in a forward of its own
    prefill_chunk: int = opt(0, range=Range(0, integer=True, note=" (0: admitted prompts are prefilled on their own)"))
    # a prompt prefix every record shares, prefilled once for the job: "auto" (detected), "off", or a file of its text
    shared_prefix: str = "auto"
    # a memory budget as written ("4GiB"): decode fits batch size and draft width into it (decode.jobs.memory)
    max_memory: str | None = None
    # decode steps compiled against preallocated key/value buffers (decode.engine.compiled.MODES): auto
    # records CUDA graphs on a GPU and runs eagerly elsewhere
    compile: str = "auto"
    kernels: str = "auto"  # kernels.BACKENDS


@dataclass
class PlacementOptions(Placement):
    """``models.loading.Placement`` as a piece of the decode options: the same fields, handed to the
    loaders as it is, its values checked with the other options (``decode.jobs.validate``) rather than
    when it is made."""

    def __post_init__(self):
        pass


@dataclass(frozen=True)
class DiffusionOptions:
    strategy: str = "static"  # a strategy spec: threshold+tau=0.8
    gen_length: int | None = opt(range=POSITIVE)
    block_size: int = opt(32, range=POSITIVE)
    steps: int | None = opt(range=POSITIVE)
    cache: str = "none"
    filter: str | None = None
    adablock: bool = False


PIECES = {"sampling": SamplingOptions, "drafting": DraftingOptions, "scheduling": SchedulingOptions,
          "placement": PlacementOptions, "diffusion": DiffusionOptions}
# option name -> the piece that holds it
PIECE_OF = {f.name: piece for piece, cls in PIECES.items() for f in dataclasses.fields(cls)}
# options a method spec can set that ``specdec decode`` has no flag for
SPEC_ONLY = tuple(f.name for cls in PIECES.values() for f in dataclasses.fields(cls) if f.metadata.get("spec_only"))


def flag(name: str) -> str:
    """How messages name an option: its flag (``--tree-tokens``), or for a method-spec-only option its
    key (``online=1``, ``max-ngram=N``)."""
    dashed = name.replace("_", "-")
    if name not in SPEC_ONLY:
        return f"--{dashed}"
    return f"{dashed}=1" if _type(name) == "bool" else f"{dashed}=N"


@dataclass(frozen=True, init=False)
class DecodeOptions:
    """The options of a decode, one piece per concern (see the module docstring)."""

    sampling: SamplingOptions
    drafting: DraftingOptions
    scheduling: SchedulingOptions
    placement: PlacementOptions
    diffusion: DiffusionOptions

    def __init__(self, sampling: SamplingOptions | None = None, drafting: DraftingOptions | None = None,
                 scheduling: SchedulingOptions | None = None, placement: Placement | None = None,
                 diffusion: DiffusionOptions | None = None, **options):
        """Pieces given whole, and single options by name on top of them (``batch_size=4``)."""
        given = {"sampling": sampling, "drafting": drafting, "scheduling": scheduling, "placement": placement, "diffusion": diffusion}
        changes: dict[str, dict] = {}
        for name, value in options.items():
            if name not in PIECE_OF:
                raise TypeError(f"DecodeOptions has no option {name!r}")
            if _type(name) in ENUMS:
                value = _convert(value, name, name)
            changes.setdefault(PIECE_OF[name], {})[name] = value
        for piece, cls in PIECES.items():
            value = given[piece] if given[piece] is not None else cls()
            if piece == "placement" and type(value) is not PlacementOptions:
                value = PlacementOptions(**{f.name: getattr(value, f.name) for f in dataclasses.fields(Placement)})
            if piece in changes:
                value = dataclasses.replace(value, **changes[piece])
            object.__setattr__(self, piece, value)

    def values(self) -> dict:
        """Every option by name, flat (what a report records)."""
        return {name: getattr(getattr(self, piece), name) for name, piece in PIECE_OF.items()}

    def given(self, piece: str) -> list[str]:
        """The options of ``piece`` that differ from their defaults, in declaration order."""
        value, default = getattr(self, piece), PIECES[piece]()
        return [f.name for f in dataclasses.fields(value) if getattr(value, f.name) != getattr(default, f.name)]

    def with_overrides(self, overrides: dict) -> "DecodeOptions":
        """These options with ``overrides`` (option name, with dashes or underscores, or an alias such as
        ``k``, to a value: a method spec's strings are converted to the option's type)."""
        changes = {}
        for raw_key, raw in overrides.items():
            key = OPTION_ALIASES.get(raw_key, raw_key).replace("-", "_")
            if key not in PIECE_OF:
                raise UsageError(f"unknown option {raw_key!r} (known: {', '.join(sorted(PIECE_OF))})")
            changes[key] = _convert(raw, key, raw_key)
        return DecodeOptions(**{piece: getattr(self, piece) for piece in PIECES}, **changes)


def _type(name: str) -> str:
    return str(next(f.type for f in dataclasses.fields(PIECES[PIECE_OF[name]]) if f.name == name))


ENUMS = {"Scheme": Scheme}


def _convert(raw, key: str, raw_key: str):
    typ = _type(key)
    if typ in ENUMS:
        enum: type[Enum] = ENUMS[typ]
        try:
            return enum(raw.value if isinstance(raw, Enum) else raw)
        except ValueError:
            raise UsageError(f"{raw_key} must be one of {', '.join(e.value for e in enum)}; not {raw!r}") from None
    if not isinstance(raw, str):
        return raw
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
        raise UsageError(f"option {raw_key}={raw!r}: {exc}") from None
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
