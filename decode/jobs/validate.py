"""Where a decode's options are checked: once, before any model loads, each refusal one ``UsageError``
(exit 2) naming the flag.

- ``validate_options``: every value in the range or among the choices its declaration states
  (``check_declared``, ``decode.options.opt``: a value outside it would decode something else than asked,
  ``--top-p 2`` samples from everything, ``--batch-size 0`` decodes nothing, or fail minutes later after
  the models load), what options rule out together, the kernels, the memory budget, the placement, a
  shared-prefix file;
- ``check_drafter_options`` (``decode.drafters.registry``): the drafter a spec names, and the drafting
  options its factory does not take; ``check_drafter_traits``: what the traits its factory declares rule
  out (an approximate mode decodes greedily);
- ``plan_decode``: the two with the target: a causal LM takes no diffusion option and a diffusion LM no
  drafting one, and the schedule each batches with. Its ``DecodePlan`` is what the job builds from:
  nothing downstream checks again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.decode.drafters.registry import DrafterChoice, check_drafter_options
from specdec.decode.options import AUTO, OPTION_ALIASES, PIECES, SCHEDULES, DecodeOptions, field_refusal, flag, parse_method
from specdec.models.artifacts import artifact_kind, read_config
from specdec.models.errors import UsageError
from specdec.models.loading import Placement, check_weights, resolve_source

DIFFUSION_ATTENTION = ("sdpa", "eager")  # what takes a dLLM's 4-D masks (models.dllm.model_mask)


def validate_options(opts: DecodeOptions) -> None:
    """Raise ``UsageError`` for the first option value that cannot be meant; return None otherwise."""
    drafting, scheduling = opts.drafting, opts.scheduling
    check_declared(opts)
    check_several_outputs(opts)
    check_weights(opts.placement.weights)
    threads = opts.placement.threads
    if threads is not None:
        _int(threads, "--threads")
        if threads < 0:
            raise UsageError(f"--threads must be >= 0 (0: chosen by the model's size and the batch), got {threads}")
    if drafting.min_draft is not None and drafting.max_draft is not None and drafting.min_draft > drafting.max_draft:
        raise UsageError(f"--min-draft ({drafting.min_draft}) must not exceed --max-draft ({drafting.max_draft})")
    if scheduling.prefill_chunk and scheduling.schedule == "static":
        raise UsageError("--prefill-chunk applies to continuous batching: static batches admit no records mid-way")
    check_kernels(scheduling.kernels)
    check_compile(scheduling.compile, opts.placement.device)
    if scheduling.max_memory is not None:
        from specdec.decode.jobs.memory import parse_size

        parse_size(scheduling.max_memory)
    check_shared_prefix(scheduling.shared_prefix)
    # the models layer's own rules for where models run (they are what loading relies on)
    Placement(**{f.name: getattr(opts.placement, f.name) for f in dataclasses.fields(Placement)})


def check_declared(opts: DecodeOptions) -> None:
    """Every option's value against what its declaration states (``decode.options.opt``: a range or a
    choice), piece by piece in declaration order; None (unset) passes."""
    for piece in PIECES:
        refusal = field_refusal(getattr(opts, piece))
        if refusal is not None:
            raise UsageError(refusal)


def check_lookup_options(drafter: DrafterChoice, drafting) -> None:
    """A head drafter takes a lookup's own options (``max_ngram``, ``--suffix-cache``) only with that lookup."""
    if "lookup" not in drafter.factory.takes:
        return
    own = {"ngram": "max_ngram", "suffix": "suffix_cache"}
    for lookup, name in own.items():
        if getattr(drafting, name) != getattr(type(drafting)(), name) and drafting.lookup != lookup:
            raise UsageError(f"{flag(name)} applies to {drafter.factory.label} only with --lookup {lookup}")


def check_kernels(kernels: str) -> None:
    """``--kernels`` names a backend this machine can run (``SPECDEC_KERNELS`` included); ``auto`` is
    resolved per device when the engine is built."""
    from specdec.kernels import BACKENDS, backend

    if kernels not in BACKENDS:
        raise UsageError(f"--kernels must be one of {', '.join(BACKENDS)}, got {kernels!r}")
    try:
        backend(kernels)
    except ValueError:
        raise UsageError(f"--kernels must be one of {', '.join(BACKENDS)}, not {os.environ.get('SPECDEC_KERNELS')!r} "
                         "(from SPECDEC_KERNELS)") from None
    except RuntimeError as exc:
        raise UsageError(f"--kernels {kernels}: {exc}") from None


def check_compile(mode: str, device: str) -> None:
    """``--compile`` names a mode, and ``graphs`` (CUDA graphs) a job that runs on a CUDA device."""
    from specdec.decode.engine.compiled import MODES

    if mode not in MODES:
        raise UsageError(f"--compile must be one of {', '.join(MODES)}, got {mode!r}")
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if mode == "graphs" and not on_cuda:
        raise UsageError("--compile graphs records CUDA graphs: it needs a CUDA device (auto runs eagerly on a CPU)")


def check_shared_prefix(spec: str) -> None:
    """``--shared-prefix``: auto, off, or a file holding text."""
    if spec in ("auto", "off"):
        return
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"--shared-prefix {spec}: no such file (or use auto / off)")
    if path.stat().st_size == 0:
        raise UsageError(f"--shared-prefix {spec}: the file is empty")


def check_drafter_traits(drafter: DrafterChoice, opts: DecodeOptions) -> None:
    """What the traits the drafter's registry entry declares (``Factory``) rule out, once the spec is
    resolved: N samples of a record at T = 0 would be N copies of one greedy output (except where the
    method's outputs differ at T = 0); an approximate mode decodes greedily (its drafts, units or exits
    stand in for the target's argmax) and, as beam search, batches by --batch-size."""
    sampling, factory = opts.sampling, drafter.factory
    check_lookup_options(drafter, opts.drafting)
    if sampling.num_samples > 1 and sampling.temperature <= 0 and not factory.several_at_greedy:
        raise UsageError(f"--num-samples {sampling.num_samples} needs --temperature > 0: greedy decoding would give "
                         f"{sampling.num_samples} identical samples")
    if factory.approximate and sampling.temperature > 0:
        raise UsageError(f"--drafter {opts.drafting.drafter} decodes greedily (an approximate mode): use --temperature 0")
    if opts.scheduling.max_memory is not None and (factory.approximate or sampling.beams > 1):
        raise UsageError("--max-memory fits the speculative engine's rows and drafts; beam search and the approximate modes "
                         "batch by --batch-size")


def check_several_outputs(opts: DecodeOptions) -> None:
    """--first-finish, --beams, --beam-groups and --diversity-penalty (their ranges declared) only where
    they mean something (first-finish samples, beam search is deterministic and drafts nothing)."""
    sampling, drafter = opts.sampling, opts.drafting.drafter
    penalty = sampling.diversity_penalty
    if sampling.first_finish:
        if sampling.first_finish < 2:
            raise UsageError(f"--first-finish must be at least 2 (samples that race to finish), got {sampling.first_finish}")
        if sampling.temperature <= 0:
            raise UsageError(f"--first-finish {sampling.first_finish} needs --temperature > 0: greedy samples would all finish together")
        if sampling.num_samples > 1:
            raise UsageError("--first-finish does not combine with --num-samples: it launches its own N samples and keeps one")
    if sampling.beams % sampling.beam_groups:
        raise UsageError(f"--beam-groups must divide --beams ({sampling.beams}) into groups of equal size, got {sampling.beam_groups}")
    if sampling.beams == 1:
        if sampling.beam_groups > 1 or penalty:
            raise UsageError("--beam-groups and --diversity-penalty apply to beam search (--beams B, B > 1)")
        return
    for name, bad in (("--temperature", sampling.temperature > 0), ("--num-samples", sampling.num_samples > 1),
                      ("--first-finish", sampling.first_finish > 0), ("--top-p", sampling.top_p < 1)):
        if bad:
            raise UsageError(f"--beams does not combine with {name}: beam search keeps the B most likely outputs")
    if drafter != "ar":
        raise UsageError(f"--beams does not combine with --drafter {drafter}: a beam's every step needs the "
                         "target's whole distribution at every beam, which drafting does not save")


def _int(value, flag: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{flag} must be an integer, got {value!r}")


# -- with the target ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodePlan:
    """A decode checked and resolved, before anything loads: the target's ``source``, whether it is a
    diffusion LM, the ``schedule`` its records batch with, and for a causal LM the ``drafter`` its spec
    names (``None`` for a diffusion LM)."""

    target: str
    source: str
    options: DecodeOptions
    is_diffusion: bool
    schedule: str
    drafter: DrafterChoice | None
    note: str | None = None  # what the job says before it starts (the choice --drafter auto made)


def plan_decode(target: str | None, options: DecodeOptions, default_target: Callable[[], str] | None = None,
                paths: tuple[str, str] | None = None) -> DecodePlan:
    """Check ``options`` (``validate_options``), the drafter spec, the drafting options its factory
    takes (``check_drafter_options``) and what its traits rule out (``check_drafter_traits``), and the
    job's ``paths`` (--in, --out) when given; then, with the target (``target``, or ``default_target()``
    when None), what applies to it. Raises ``UsageError``."""
    auto = options.drafting.drafter == AUTO
    # with auto, the options are checked here as plain decoding's, and again with the drafter it picks
    validate_options(options.with_overrides({"drafter": "ar"}) if auto else options)
    if not auto:
        drafter = check_drafter_options(options.drafting.drafter, options)
        check_drafter_traits(drafter, options)
    if paths is not None:
        validate_paths(*paths)
    target = target if target is not None else default_target()
    source = resolve_source(target)
    diffusion = is_diffusion_model(source, options)
    note = None
    if auto and diffusion:
        options = options.with_overrides({"drafter": "ar"})  # a diffusion LM decodes without a drafter
    elif auto:
        options, drafter, note = resolve_auto(source, options)
    schedule = resolve_schedule(options.scheduling.schedule, diffusion, target)
    if diffusion:
        causal_only = [flag(n) for n in options.given("drafting")]
        causal_only += [flag(n) for n in ("max_memory", "prefill_chunk") if n in options.given("scheduling")]
        if options.placement.attn_implementation not in (None, *DIFFUSION_ATTENTION):
            causal_only.append(f"--attn-implementation {options.placement.attn_implementation}")
        if causal_only:
            raise UsageError(f"{target} is a diffusion LM: {_listed(causal_only)} to causal LMs only")
        return DecodePlan(target, source, options, True, schedule, None)
    given = [flag(n) for n in options.given("diffusion")]
    if given:
        raise UsageError(f"{target} is a causal LM: {_listed(given)} to diffusion LMs only")
    return DecodePlan(target, source, options, False, schedule, drafter, note)


def resolve_auto(source: str, options: DecodeOptions) -> tuple[DecodeOptions, DrafterChoice, str]:
    """``--drafter auto``: the fastest lossless method measured for the target's family (its
    ``fastest.json``, when the drafter it names ships, under the conditions it was measured at; elsewhere the
    first of its ``otherwise`` rules whose conditions hold), else ``ngram``; ``ar`` where the other options
    rule the candidate out (beams, an approximate mode's options, ...). The options with the choice, the
    choice, and the line that says why."""
    from specdec.models.artifacts import family_winner

    winner = family_winner(source)
    values = options.values()
    differ = _unmet((winner or {}).get("when", {}), values)
    if winner is not None and not differ:
        spec, why = winner["method"], f"the fastest lossless method measured for {winner['family']} ({winner['summary']})"
    elif winner is not None and (rule := next((r for r in winner["otherwise"] if not _unmet(r["when"], values)), None)):
        spec, why = rule["method"], (f"the fastest lossless method measured for {winner['family']} at {_listed_values(rule['when'])} "
                                     f"({rule['summary']})")
    elif winner is not None:
        spec, why = "ngram", (f"{winner['method']} is the fastest measured for {winner['family']} at {_listed_values(winner['when'])}, "
                              f"not at {', '.join(differ)}")
    else:
        spec, why = "ngram", "no faster drafter ships for this target; n-gram lookup needs none"
    refusal = None
    mine = {name for piece in PIECES for name in options.given(piece)}  # the user's own options win over a winner's
    for candidate, reason in ((spec, why), ("ar", "the other options take plain decoding")):
        head, overrides = parse_method(candidate)  # a measured method's options (``trimmed+lookup=ngram``) come with it
        kept = {k: v for k, v in overrides.items() if OPTION_ALIASES.get(k, k).replace("-", "_") not in mine}
        try:
            chosen = options.with_overrides({**kept, "drafter": head})
            validate_options(chosen)
            drafter = check_drafter_options(head, chosen)
            check_drafter_traits(drafter, chosen)
        except UsageError as exc:
            refusal = exc
            continue
        return chosen, drafter, f"drafter: {candidate} (auto: {reason})"
    raise refusal  # plain decoding's own refusal: the options need a drafter named with --drafter


def _unmet(when: dict, values: dict) -> list[str]:
    """The decode options (``name value``) that differ from the conditions a method was measured at."""
    return [f"{k} {values.get(k)}" for k, v in when.items() if values.get(k) != v]


def _listed_values(when: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in when.items())


def _listed(flags: list[str]) -> str:
    return f"{flags[0]} applies" if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]} apply"


def resolve_schedule(schedule: str, is_diffusion: bool, target: str) -> str:
    """``continuous`` or ``static``: auto is continuous for causal LMs, static for diffusion LMs, whose
    canvas decodes a batch's rows in lockstep (an explicit ``continuous`` there is a usage error)."""
    if schedule not in SCHEDULES:
        raise UsageError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if is_diffusion:
        if schedule == "continuous":
            raise UsageError(f"{target} is a diffusion LM: its records decode in static batches (--schedule continuous applies to causal LMs)")
        return "static"
    return "static" if schedule == "static" else "continuous"


def is_diffusion_model(path, options: DecodeOptions) -> bool:
    """specdec's dLLMs say so in config.json; third-party ones (LLaDA, Dream) carry a mask token id
    and run their own code, so they are recognised only with --trust-remote-code."""
    if not Path(path).is_dir():  # a hub id: a causal LM (diffusion checkpoints load from folders)
        return False
    if artifact_kind(path) == "dllm":
        return True
    return options.placement.trust_remote_code and read_config(path).get("mask_token_id") is not None


# -- paths ----------------------------------------------------------------------------------------


def validate_paths(in_path: str, out_path: str) -> None:
    """Refuse an unusable ``--in`` or ``--out`` with one ``UsageError`` before any model loads.

    Creates nothing. ``-`` is stdin / stdout. The output's nearest existing ancestor must be a
    writable directory (the output, its lock file and missing parent folders are created there).
    """
    try:
        _validate_paths(in_path, out_path)
    except OSError as exc:  # e.g. a folder on the way that may not be searched
        flag = "--out" if exc.filename and in_path not in (exc.filename, "-") else "--in"
        raise UsageError(f"{flag} {exc.filename or ''}: {exc.strerror or exc}".replace(" :", ":")) from None


def _validate_paths(in_path: str, out_path: str) -> None:
    if in_path != "-":
        src = Path(in_path)
        if not src.exists():
            raise UsageError(f"--in {in_path}: no such file")
        if src.is_dir():
            raise UsageError(f"--in {in_path} is a directory, not a JSONL file")
        if not os.access(src, os.R_OK):
            raise UsageError(f"--in {in_path}: permission denied")
    if out_path == "-":
        return
    validate_output_path(out_path, "--out", stdout_hint=" (or - for stdout)")
    if Path(out_path).exists() and in_path != "-" and os.path.samefile(in_path, out_path):
        raise UsageError(f"--in and --out are the same file ({out_path})")


def validate_output_path(path: str, flag: str, stdout_hint: str = "") -> None:
    """Refuse an output file that could not be written (a folder, not a regular file, not writable, a
    file on the way) with one ``UsageError`` naming ``flag``; creates nothing. The nearest existing
    ancestor must be a writable folder (missing parent folders are created there when writing)."""
    out = Path(path)
    if path.endswith(os.sep) or out.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file path{stdout_hint}")
    if out.exists():
        if not out.is_file():
            raise UsageError(f"{flag} {path} is not a regular file{stdout_hint}")
        if not os.access(out, os.W_OK):
            raise UsageError(f"{flag} {path}: permission denied")
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot create files in {parent} (permission denied)")
