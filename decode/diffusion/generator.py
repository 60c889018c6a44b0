"""Masked-diffusion LM (dLLM) decoding: one step loop, one commit rule per strategy.

A batch is laid out as a *canvas*: left-padded prompts followed by ``gen_length`` MASK tokens.
The canvas is decoded segment by segment (semi-autoregressive blocks of ``block_size``); inside a
segment every step runs one forward, turns the logits into a proposal (token + confidence per
position) and asks the strategy's ``select`` function which masked positions to commit. Strategies
differ only in that function (``decode.diffusion.strategies``); the loop, the caches (``decode.diffusion.canvas``),
end-of-text handling and batching are shared.

Invariants every strategy keeps (tests/test_diffusion.py checks them): at least one token is
committed per step for every row that still has masked positions in its window, nothing outside
the current segment is committed, and a committed token is never rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from specdec.decode.diffusion.canvas import CACHE_MODES, Canvas, SegmentForward, build_canvas
from specdec.decode.options import DecodeOptions
from specdec.decode.options import parse_method as parse_spec
from specdec.decode.diffusion.strategies import NEG_INF, STRATEGIES, Selection, StepContext, StepView, commit_tokens, make_options, propose
from specdec.decode.engine.types import GenRequest, GenResult
from specdec.kernels import backend as pick_backend
from specdec.kernels.diffusion_select import CreditState, rank_of, select_step
from specdec.models.artifacts import resolve_member
from specdec.models.dllm import DllmSpec, load_dllm, load_filter
from specdec.models.errors import SpecdecError
from specdec.models.loading import apply_threads, resolve_device



# --------------------------------------------------------------------------------------------
# The generator: one step loop for every strategy
# --------------------------------------------------------------------------------------------


@dataclass
class StepEvent:
    """One step as seen by an ``on_step`` observer: the segment's tokens before and after the commit."""

    a0: int
    rows: Tensor
    before: Tensor
    after: Tensor
    selectable: Tensor


@dataclass
class _Window:
    """Per-row decode window inside the segment: the whole segment, or AdaBlock's shorter pieces."""

    end: Tensor  # [b]
    step: Tensor  # [b]
    masked: Tensor  # [b]
    steps: Tensor  # [b]


class DiffusionGenerator:
    """Masked-diffusion decoding: ``generate`` takes one batch of requests and returns one result per
    request in the same order, as ``SpecEngine.generate`` does.

    ``cache="prefix"|"dual"`` are approximate (Fast-dLLM style, see ``SegmentForward``) and every
    result they produce carries ``"approximate": true`` in its stats. ``freedave`` reproduces greedy
    one-token-per-step ``static`` exactly (given deterministic kernels) with fewer forwards.
    ``adablock=True`` composes with any strategy: a confident predicted newline ends the decode
    window early, so text after a line break waits until the line is done.

    ``kernels`` ("auto", "triton", "torch"): when it resolves to triton, greedy threshold, factor and
    credit steps run fused in ``kernels.diffusion_select.select_step`` (one pass over the logits, no
    softmax materialised), which commits exactly what the strategy's reference rule commits. AdaBlock
    reads the plain proposal to place the window before the rule runs, so it keeps the reference path.
    """

    expands_samples = False  # a record's samples are rows of their own, as in SpecEngine

    def __init__(
        self,
        model,
        tokenizer,
        spec: DllmSpec,
        strategy: str = "static",
        gen_length: int = 128,
        block_size: int = 32,
        steps: int | None = None,
        temperature: float = 0.0,
        cache: str = "none",
        filter_dir: str | Path | None = None,
        adablock: bool = False,
        adablock_threshold: float = 0.3,
        seed: int = 0,
        kernels: str = "torch",
        on_step: Callable[[StepEvent], None] | None = None,
        **strategy_options,
    ):
        self.options = make_options(strategy, strategy_options)
        self.strategy_name, self.strategy = strategy, STRATEGIES[strategy]
        if cache not in CACHE_MODES:
            raise SpecdecError(f"--cache must be one of {', '.join(CACHE_MODES)}, not {cache!r}")
        if cache != "none" and spec.attention == "native":
            raise SpecdecError("--cache prefix|dual needs a specdec dLLM; remote-code models decode with --cache none")
        if gen_length < 1 or block_size < 1 or (steps is not None and steps < 1):
            raise SpecdecError("--gen-length, --block-size and --steps must be positive")
        if strategy == "freedave" and temperature > 0:
            raise SpecdecError("freedave is lossless only for greedy decoding: use --temperature 0")
        if strategy == "learn2pd" and filter_dir is None:
            raise SpecdecError("learn2pd needs a trained filter: --filter DIR (specdec train-filter)")
        self.gen_length, self.block_size, self.steps, self.cache = gen_length, block_size, steps, cache
        self.temperature, self.seed = temperature, seed
        self.adablock, self.adablock_threshold = adablock, adablock_threshold
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.filter = None if filter_dir is None else load_filter(filter_dir).to(model.device)
        self.delimiters = delimiter_ids(tokenizer) if adablock else []
        self.filler = spec.eos_token_id if spec.eos_token_id is not None else 0
        self.kernels = pick_backend(kernels, model.device)
        rule = self.strategy.kernel_rule
        fusable = rule is not None and self.kernels == "triton" and temperature == 0 and not adablock
        self.fused_rule = rule(self.options) if fusable else None  # select_step arguments, or None: the reference path
        self.on_step = on_step  # instrumentation (tests, tracing); costs nothing when None

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        if not requests:
            return []
        spec = self.spec
        budgets = [max(1, min(r.max_new_tokens, self.gen_length)) for r in requests]
        canvas = build_canvas([r.prompt_ids for r in requests], budgets, spec, self.filler, self.model.device)
        counter = [0]
        row_steps = torch.zeros(len(requests), dtype=torch.long, device=canvas.tokens.device)
        batch_steps = 0
        finished = [False] * len(requests)
        for a0 in range(0, canvas.gen_length, self.block_size):
            a1 = min(a0 + self.block_size, canvas.gen_length)
            active = [r for r, done in enumerate(finished) if not done and budgets[r] > a0]
            if not active:
                break
            rows = torch.tensor(active, device=canvas.tokens.device)
            block, steps, committed = self._decode_segment(canvas, rows, a0, a1, counter)
            canvas.tokens[rows, canvas.prompt_len + a0 : canvas.prompt_len + a1] = block
            row_steps.index_add_(0, rows, committed)
            batch_steps += steps
            if spec.eos_token_id is not None:
                for r, has_eos in zip(active, (block == spec.eos_token_id).any(-1).tolist()):
                    finished[r] = finished[r] or has_eos
        return self._results(canvas, row_steps.tolist(), batch_steps, counter[0])

    def _decode_segment(self, canvas: Canvas, rows: Tensor, a0: int, a1: int, counter: list[int]):
        spec = self.spec
        p = canvas.prompt_len
        block = canvas.tokens[rows, p + a0 : p + a1].clone()
        forward = SegmentForward(self.model, spec, canvas, rows, a0, a1, self.cache, counter)
        generator = torch.Generator(device=block.device).manual_seed(self.seed + a0) if self.temperature > 0 else None
        ctx = StepContext(forward, spec.mask_token_id, spec.eos_token_id, self.temperature, generator, rows, a0, self.filter)
        b = block.shape[0]
        zeros = torch.zeros(b, dtype=torch.long, device=block.device)
        window = _Window(end=zeros, step=zeros.clone(), masked=zeros.clone(), steps=zeros.clone())
        scratch: dict = {}
        committed = torch.zeros(b, dtype=torch.long, device=block.device)
        logits = forward.first()
        steps = 0
        while True:
            masked = block == ctx.mask_id
            # The one host sync per step: is anything left to decode in this segment?
            if not bool(masked.any()):
                break
            if logits is None:
                logits = forward(block)
            sel, selectable, window = self._select(logits, block, masked, window, ctx, scratch)
            commit = sel.commit & masked  # never rewrite a committed token
            before = block
            block = commit_tokens(block, commit, sel.tokens, ctx)
            if self.on_step is not None:
                self.on_step(StepEvent(a0, rows, before, block, selectable))
            logits = sel.next_logits
            committed += commit.any(-1).long()
            window.step = window.step + 1
            steps += 1
        return block, steps, committed

    def _select(self, logits: Tensor, block: Tensor, masked: Tensor, window: _Window, ctx: StepContext, scratch: dict):
        """(the step's Selection with the tokens to write, the selectable positions, the decode window)."""
        cols = torch.arange(block.shape[1], device=block.device)
        if self.fused_rule is not None:
            window = self._advance_windows(window, masked, cols)
            selectable = masked & (cols[None] < window.end[:, None])
            credit = scratch.get("credit")
            if credit is None and self.fused_rule["rule"] == "credit":  # as many slots as the segment has steps at most
                credit = CreditState.empty(block.shape[0], block.shape[1], slots=block.shape[1], device=block.device)
            fused = select_step(logits, selectable, **self.fused_rule, credit=credit, mask_id=ctx.mask_id, backend=self.kernels)
            scratch["credit"] = fused.credit
            return Selection(fused.commit, tokens=fused.tokens), selectable, window
        x0, conf, probs = propose(logits, self.temperature, ctx.generator, ctx.mask_id)
        window = self._advance_windows(window, masked, cols, x0, conf)
        selectable = masked & (cols[None] < window.end[:, None])
        conf = conf.masked_fill(~selectable, NEG_INF)
        view = StepView(logits, probs, x0, conf, rank_of(conf), selectable, block, window.step, window.masked, window.steps, ctx, scratch)
        sel = self.strategy.select(view, self.options)
        return Selection(sel.commit, x0 if sel.tokens is None else sel.tokens, sel.next_logits), selectable, window

    def _advance_windows(self, window: _Window, masked: Tensor, cols: Tensor, x0: Tensor | None = None, conf: Tensor | None = None) -> _Window:
        """Open a new window for rows whose window is done; without AdaBlock it is the whole segment
        (AdaBlock reads the proposal ``x0`` and its ``conf``)."""
        open_new = ~(masked & (cols[None] < window.end[:, None])).any(-1) & masked.any(-1)
        start = window.end
        end = torch.full_like(start, cols.shape[0])
        if self.adablock and self.delimiters:
            # AdaBlock: the first confidently predicted delimiter after the window start ends the window.
            is_delim = torch.isin(x0, torch.tensor(self.delimiters, device=x0.device))
            cand = is_delim & masked & (cols[None] >= start[:, None]) & (conf >= self.adablock_threshold)
            end = torch.where(cand.any(-1), cand.long().argmax(-1) + 1, end)
        new_end = torch.where(open_new, end, window.end)
        in_window = masked & (cols[None] >= torch.where(open_new, start, 0)[:, None]) & (cols[None] < new_end[:, None])
        steps = self._window_steps(new_end - start) if self.steps is not None else torch.zeros_like(start)
        return _Window(
            end=new_end,
            step=torch.where(open_new, 0, window.step),
            masked=torch.where(open_new, in_window.sum(-1), window.masked),
            steps=torch.where(open_new, steps, window.steps),
        )

    def _window_steps(self, width: Tensor) -> Tensor:
        # LLaDA splits steps evenly over blocks; a shorter (AdaBlock or last) window gets its share.
        per_block = max(1, self.steps * self.block_size // self.gen_length)
        return (per_block * width + self.block_size - 1).div(self.block_size, rounding_mode="floor").clamp(min=1)

    def _results(self, canvas: Canvas, row_steps: list[int], batch_steps: int, calls: int) -> list[GenResult]:
        eos = self.spec.eos_token_id
        answers = canvas.tokens[:, canvas.prompt_len :].tolist()
        results = []
        for row, budget in enumerate(canvas.budgets):
            tokens = answers[row][:budget]
            stop = eos is not None and eos in tokens
            if stop:
                tokens = tokens[: tokens.index(eos)]
            stats = {
                "target_calls": calls,
                "steps": row_steps[row],
                "batch_steps": batch_steps,
                "decoded_tokens": len(tokens) + int(stop),
                "strategy": self.strategy_name,
                "cache": self.cache,
                "approximate": self.cache != "none",
                "gen_length": self.gen_length,
                "block_size": self.block_size,
            }
            results.append(GenResult(tokens, "stop" if stop else "length", stats))
        return results


def delimiter_ids(tokenizer) -> list[int]:
    """Token ids that end a line (AdaBlock's delimiter), found through the tokenizer, not by model name."""
    ids = set()
    vocab = tokenizer.get_vocab()
    for token, idx in vocab.items():
        text = tokenizer.convert_tokens_to_string([token])
        if text.endswith("\n") and text.strip() == "":
            ids.add(idx)
    return sorted(ids)


# --------------------------------------------------------------------------------------------
# Method specs and building a generator from decode options
# --------------------------------------------------------------------------------------------


@dataclass
class Method:
    label: str
    strategy: str
    options: dict = field(default_factory=dict)

    def generator_kwargs(self) -> dict:
        kwargs = {k: v for k, v in self.options.items() if k != "filter"}
        if "filter" in self.options:
            kwargs["filter_dir"] = resolve_member(str(self.options["filter"]))
        return kwargs


def parse_method(text: str) -> Method:
    """A diffusion method spec, ``threshold+tau=0.8``: the strategy and its typed options (the same
    ``name+key=value`` syntax as every method spec, ``decode.options.parse_method``)."""
    strategy, pairs = parse_spec(text.strip())
    return Method(text.strip(), strategy, {key.replace("-", "_"): _parse_value(value) for key, value in pairs.items()})


def _parse_value(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def load_for_decoding(path: str | Path, options: DecodeOptions):
    """(model, tokenizer, spec): the dLLM at ``path`` placed as ``options`` say."""
    placement = options.placement
    device = resolve_device(placement.device)
    # auto: as saved on a GPU, float32 on a CPU (the same rule as causal LMs)
    dtype = placement.dtype if placement.dtype != "auto" else (None if device.type == "cuda" else "float32")
    model, tokenizer, spec = load_dllm(path, trust_remote_code=placement.trust_remote_code, dtype=dtype,
                                       attn_implementation=placement.attn_implementation, device_map=placement.device_map)
    if not placement.device_map:
        model.to(device)
    # every forward reads the whole canvas
    apply_threads(placement.threads, model, rows=options.scheduling.batch_size * options.sampling.max_new_tokens)
    return model, tokenizer, spec


def build_generator(model, tokenizer, spec: DllmSpec, options: DecodeOptions) -> DiffusionGenerator:
    """The generator ``options`` describe; ``options.diffusion.strategy`` is a method spec (``threshold+tau=0.8``)
    whose options override the others (``static+cache=dual``)."""
    diffusion, sampling = options.diffusion, options.sampling
    method = parse_method(diffusion.strategy)
    kwargs = {
        "gen_length": diffusion.gen_length or sampling.max_new_tokens,
        "block_size": diffusion.block_size,
        "steps": diffusion.steps,
        "temperature": sampling.temperature,
        "cache": diffusion.cache,
        "filter_dir": None if diffusion.filter is None else resolve_member(diffusion.filter),
        "seed": sampling.seed,
        "adablock": diffusion.adablock,
        "kernels": pick_backend(options.scheduling.kernels, model.device),
    }
    return DiffusionGenerator(model, tokenizer, spec, method.strategy, **(kwargs | method.generator_kwargs()))


def generator_from_options(path: str | Path, options: DecodeOptions) -> tuple[DiffusionGenerator, object, int]:
    """The job runner's hook: (generator, tokenizer, max context) from its ``DecodeOptions``."""
    model, tokenizer, spec = load_for_decoding(path, options)
    generator = build_generator(model, tokenizer, spec, options)
    return generator, tokenizer, getattr(model.config, "max_position_embeddings", None) or 1 << 30
