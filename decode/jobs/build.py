"""Building what decodes from checked options: the target placed for decoding, and the engine.

``build_engine`` is the one way an engine is made from ``DecodeOptions``: the decode job, every pass
of the bench and the scripts build theirs here, so they sample, stop, schedule, prefill and pick
kernels alike. The options are checked before (``decode.jobs.validate``), not here.
"""

from __future__ import annotations

from pathlib import Path

from specdec.decode.drafters.base import Drafter
from specdec.decode.drafters.registry import DrafterChoice, build_drafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.own import OwnLoop
from specdec.decode.engine.verify import Sampling
from specdec.decode.options import DecodeOptions
from specdec.kernels import backend
from specdec.models.loading import input_device, load_target


def load_decode_target(target: str, options: DecodeOptions):
    """(model, tokenizer, source) placed by the options, threads set for forwards of the batch's rows;
    with the Triton backend, tree attention runs through specdec's own attention function."""
    model, tokenizer, source = load_target(target, options.placement, rows=options.scheduling.batch_size)
    if backend(options.scheduling.kernels, input_device(model)) == "triton":
        from specdec.kernels.tree_attention import register

        model.set_attn_implementation(register())
    return model, tokenizer, source


def shared_prefix_tokens(spec: str, tokenizer):
    """The engine's shared-prefix setting for ``--shared-prefix``: None (off), "auto", or the token ids
    of a file's text, tokenized as a prompt is (special tokens included, so a BOS matches)."""
    if spec == "off":
        return None
    if spec == "auto":
        return "auto"
    return tokenizer(Path(spec).read_text(encoding="utf-8"), add_special_tokens=True)["input_ids"]


def build_engine(target, tokenizer, options: DecodeOptions, drafter: Drafter | DrafterChoice | OwnLoop | None = None,
                 **engine) -> SpecEngine | OwnLoop:
    """The engine ``options`` describe over a loaded ``target``: its drafter (a built one, a resolved
    spec, or None: the spec in ``options.drafting``), sampling and seed, stop strings, draft length,
    kernels (resolved for the device of the target's inputs), shared prefix, compiled steps and prefill
    chunks. ``engine``: ``SpecEngine`` settings no option covers (``eos_ids``, ``min_shared``,
    ``hold_prefix_once``, ``adaptive_length``, ...).

    A method with a loop of its own (``decode.engine.own``) is returned as it is: beam search (``--beams``)
    and the approximate modes, which the drafter registry builds from the same options."""
    if options.sampling.beams > 1:
        from specdec.decode.engine.beams import BeamSearch

        return BeamSearch(target, tokenizer, options)
    if drafter is None:
        drafter = build_drafter(options.drafting.drafter, target, tokenizer, options)
    if isinstance(drafter, DrafterChoice):
        drafter = drafter.build(target, tokenizer, options)
    if isinstance(drafter, OwnLoop):
        return drafter
    sampling, scheduling = options.sampling, options.scheduling
    return SpecEngine(
        target,
        tokenizer,
        drafter,
        Sampling(sampling.temperature, sampling.top_p),
        num_draft=options.drafting.num_draft,
        seed=sampling.seed,
        stop=sampling.stop,
        kernels=backend(scheduling.kernels, input_device(target)),
        shared_prefix=shared_prefix_tokens(scheduling.shared_prefix, tokenizer),
        compile=scheduling.compile,
        prefill_chunk=scheduling.prefill_chunk,
        first_finish=sampling.first_finish > 0,
        **engine,
    )
