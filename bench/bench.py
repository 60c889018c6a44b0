"""``specdec bench``: every method on the same prompts, in one process, after warm-up.

Speedup is tokens/s of a method over tokens/s of ``ar`` measured in the same run, timed as every
bench times (``bench.timing``): each of the ``--repeats R`` passes decodes every prompt with every
method, interleaved batch by batch, and the speedup is the median over passes of the ratio to that
pass's ``ar``. A dLLM target runs the diffusion bench (``bench.diffusion_bench``). tau counts the
bonus token (tokens per target forward). Beside every speedup: the distinct-4-gram ratio of the
outputs (repetition inflates speedups) and the ideal speedup S = tau / (c_round + v) from measured
forward costs, where c_round is the drafting cost of one round and v the mean cost of the verification
forwards (each at the width it ran), both in units of one single-token target forward; efficiency = measured / ideal. With
``num_samples`` N, a prompt's N samples decode as adjacent rows of one batch (``--batch-size`` prompts,
N times as many rows) and together are the prompt's output: their tokens and counters summed.

Memory: on CUDA, ``peak_mib`` is the most memory allocated while the method's timed chunks ran (the
peak counter reset before each chunk, the max over the run; whatever else is resident, the target's
weights included, counts too). A CPU process's peak RSS cannot be split between interleaved methods,
so the config holds the run's ``peak_rss_mib`` and ``peak_mib`` is None there. ``kv_estimate_mib``, on
every device, is an ESTIMATE from ``decode.jobs.memory``'s model, not a measurement: the KV caches, verify
logits and hidden states of one batch of rows at the longest prompt of the run, weights excluded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec.bench import diffusion_bench, llamacpp, quality
from specdec.decode.diffusion.generator import parse_method as parse_strategy
from specdec.decode.diffusion.strategies import PUBLIC_STRATEGIES, STRATEGIES
from specdec.decode.drafters.registry import DrafterChoice, named_factory, refuse_what_does_not_apply, resolve_drafter
from specdec.decode.engine.own import OwnLoop
from specdec.decode.jobs.build import build_engine, load_decode_target
from specdec.decode.jobs.io import read_records
from specdec.decode.jobs.memory import draft_width, memory_model
from specdec.decode.jobs.validate import check_drafter_traits, is_diffusion_model, validate_options
from specdec.decode.options import DecodeOptions, parse_method
from specdec.bench.roofline import nominal_bandwidth, peak_bandwidth, roofline
from specdec.bench.report import plot, provenance, shown_home, shown_path
from specdec.bench.timing import Run, Runner, run_passes, speedup, tokens_per_s
from specdec.decode.measure import distinct_ngram_ratio, time_forward
from specdec.decode.engine.types import GenRequest, add_counts
from specdec.models import blocks
from specdec.models.artifacts import resolve_member
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.threads import held, torch_default
from specdec.models.loading import input_device, load_draft, resolve_source, reuse_loaded


@dataclass
class BenchConfig:
    """What ``specdec bench`` runs and how it times it; ``options`` are the decode options every method
    starts from (the ones ``specdec decode`` takes), which a method spec's ``+key=value`` overrides."""

    in_path: str
    target: str | None = None
    methods: list = field(default_factory=lambda: ["ar"])
    repeats: int = 1
    warmup: int = 2
    limit: int | None = None
    busy: int = 0  # competing CPU-bound processes kept running from the target's load to the last pass
    command: str | None = None  # recorded in the report (default: this process's command line)
    options: DecodeOptions = field(default_factory=lambda: DecodeOptions(batch_size=1))


# what needs no trained artifact, beside transformers' own decoding (the tool a user would otherwise use)
DEFAULT_METHODS = ("ar", "ngram", "recycle", "layerskip", "hf-generate", "hf-lookup")
DEFAULT_DIFFUSION_METHODS = ("static", "threshold", "factor", "credit")


@dataclass(frozen=True)
class Method:
    """A method spec checked before anything loads: the options it decodes with (the base options with
    the spec's overrides) and the drafter it names (None for a peer, ``hf-*``, or a diffusion strategy)."""

    spec: str
    options: DecodeOptions
    drafter: DrafterChoice | None = None


@dataclass(frozen=True)
class BenchPlan:
    target: str
    source: str
    is_diffusion: bool
    methods: dict  # spec -> Method (the causal bench's, ``ar`` first)


def plan_bench(cfg: BenchConfig, default_target: Callable[[], str] | None = None) -> BenchPlan:
    """Every method spec checked, with the base options, before anything loads (``cfg.target`` None:
    ``default_target()``, asked for only once the specs are): a spec that names no method, an option
    that is unknown or out of range, or one that does not apply to the method's drafter, is a
    ``UsageError``. Specs name drafters for a causal target and strategies for a diffusion LM."""
    base = cfg.options
    validate_options(base)
    parsed, unresolved = {}, {}
    for spec in cfg.methods:
        if llamacpp.is_llamacpp(spec):
            llamacpp.check_installed(spec)
            continue
        if spec.startswith("hf-"):
            _check_peer(spec)
            continue
        head, overrides = parse_method(spec)
        try:
            choice = resolve_drafter(head)
        except UsageError as exc:
            if parse_strategy(head).strategy not in STRATEGIES:  # neither a drafter nor a diffusion strategy
                raise UsageError(f"method {spec!r}: {exc}") from None
            unresolved[spec] = exc  # a strategy's options are its own (decode.diffusion.strategies)
            continue
        opts = base.with_overrides({**overrides, "drafter": head})  # what a decode with --drafter HEAD would check
        validate_options(opts)
        refuse_what_does_not_apply(choice.factory, opts.drafting)
        check_drafter_traits(choice, opts)
        parsed[spec] = (opts, choice)
    target = cfg.target if cfg.target is not None else default_target()
    source = resolve_source(target)
    if is_diffusion_model(source, base):
        for spec in [*parsed, *unresolved]:
            strategy = parse_strategy(parse_method(spec)[0]).strategy
            if strategy not in STRATEGIES:
                raise UsageError(f"method {spec!r}: {target} is a diffusion LM, and {strategy!r} is not one of its "
                                 f"strategies ({', '.join(PUBLIC_STRATEGIES)})")
        return BenchPlan(target, source, True, {spec: Method(spec, base) for spec in cfg.methods or DEFAULT_DIFFUSION_METHODS})
    for spec, exc in unresolved.items():
        raise UsageError(f"method {spec!r}: {exc}")
    specs = list(cfg.methods or DEFAULT_METHODS)
    if "ar" not in specs:
        specs.insert(0, "ar")
    methods = {}
    probed = False
    for spec in specs:
        if is_peer(spec):
            if llamacpp.is_llamacpp(spec):
                path = llamacpp.gguf_file(source, spec)  # a target that is no GGUF file is refused before anything loads
                if not probed:  # and a llama.cpp build that crashes here, before any method is measured
                    llamacpp.probe(spec, path)
                    probed = True
            methods[spec] = Method(spec, base)
            continue
        if spec not in parsed:  # a default method
            choice = resolve_drafter(spec)
            parsed[spec] = (base, choice)
            refuse_what_does_not_apply(choice.factory, base.drafting)
            check_drafter_traits(choice, base)
        methods[spec] = Method(spec, *parsed[spec])
    return BenchPlan(target, source, False, methods)


def run_bench(cfg: BenchConfig, console=None, default_target: Callable[[], str] | None = None) -> dict:
    plan = plan_bench(cfg, default_target)
    target_path = plan.source
    records = [r for r in read_records(cfg.in_path) if r.error is None and r.prompt is not None]
    if cfg.limit:
        records = records[: cfg.limit]
    if not records:
        raise SpecdecError(f"{cfg.in_path}: no usable prompts")
    with competing_load(cfg.busy):
        if plan.is_diffusion:
            report = diffusion_bench.bench_diffusion(str(target_path), [r.extra for r in records], list(plan.methods), cfg.options,
                                                     repeats=cfg.repeats, warmup=cfg.warmup, command=cfg.command)
            report["config"]["busy"] = cfg.busy
            return report
        return _bench_causal(cfg, plan, records, console)


def _bench_causal(cfg: BenchConfig, plan: BenchPlan, records: list, console) -> dict:
    base, target_path = cfg.options, plan.source
    model, tok, _ = load_decode_target(str(target_path), base)  # one thread setting for every method of the run
    prompts = [tok(r.prompt)["input_ids"] for r in records]
    categories = [r.category or "all" for r in records]
    methods = list(plan.methods)
    device = input_device(model)
    peak = peak_bandwidth(device)  # before the methods: nothing else holds the memory bus
    prepared = {}
    with reuse_loaded():  # each pass rebuilds its drafters: their frozen weights are read once
        for spec in methods:
            if console is not None:
                console.print(f"[bold]bench[/bold] {spec}")
            prepared[spec] = _prepare_method(spec, model, tok, prompts, plan.methods[spec], cfg.warmup)  # builds and warms up
        runners = {spec: m.runner for spec, m in prepared.items()}
        peaks = {spec: _PeakMemory(runner, device) for spec, runner in runners.items()}
        runs = run_passes(runners, len(prompts), base.scheduling.batch_size, cfg.repeats)
    # greedy rounds and sampling races (top-p 1: verify.race_noise) read the screened output layer
    costs = _ForwardCosts(model, prompts, greedy=base.sampling.temperature == 0 or base.sampling.top_p >= 1.0)
    tasks = [(r.prompt, r.extra) for r in records] if any(r.extra.get("answer") is not None for r in records) else None
    entries = [_entry(spec, runs[spec], runs["ar"], categories, costs, prepared[spec].draft_model, base, tasks, tok,
                      is_peer(spec) or _one_row_per_prompt(plan.methods[spec].options, prepared[spec])) for spec in methods]
    lens = [len(p) for p in prompts]
    for spec, entry in zip(methods, entries):
        sampling = plan.methods[spec].options.sampling
        if (sampling.first_finish or sampling.num_samples) > 1:  # tokens/s counts every sample's tokens
            entry["rows_per_prompt"] = sampling.first_finish or sampling.num_samples
        estimate = prepared[spec].kv_estimate_bytes
        entry.update(peak_mib=peaks[spec].mib(), kv_estimate_mib=None if estimate is None else round(estimate / (1 << 20), 3))
        # transformers' own runs report no forward counts; the model reads a prompt's stats as one row's
        # a drafter drafting with the target's layers (Factory.in_target) runs forwards the count of verifications misses
        if not is_peer(spec) and _one_row_per_prompt(plan.methods[spec].options, prepared[spec]) and not _in_target(spec):
            entry.update(roofline(runs[spec].stats, lens, base.scheduling.batch_size, statistics.median(runs[spec].walls), peak, model,
                                  prepared[spec].draft_model, blocks=plan.methods[spec].options.placement.weights != "float32"))
    nominal = nominal_bandwidth(device)
    return {
        "kind": "speculative",
        "config": _config(cfg) | {"target": shown_path(target_path), "prompts": len(prompts), "peak_gbps_copy": round(peak / 1e9, 2),
                                  "peak_gbps_nominal": None if nominal is None else round(nominal / 1e9, 1),
                                  "peak_rss_mib": peak_rss_mib()},
        "methods": entries,
        **provenance(cfg.command, input_device(model)),
    }


@contextlib.contextmanager
def competing_load(n: int):
    """``n`` processes that each keep one core busy (a pure-Python spin loop) until the block ends: the
    state of a shared machine or a laptop, where specdec and transformers' peers are measured alike."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        if procs:
            time.sleep(1.0)  # the load is on before the target loads and threads are chosen
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _config(cfg: BenchConfig) -> dict:
    """The bench's settings and the resolved decode options, flat (the methods name the drafters)."""
    bench = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("options", "command")}
    bench["in_path"] = shown_path(cfg.in_path)
    bench["methods"] = [shown_home(m) for m in cfg.methods]  # as the method rows name them: no machine's paths
    options = {k: v for k, v in cfg.options.values().items() if k not in ("drafter", "strategy")}
    return bench | options


# -- running one method -----------------------------------------------------------------------


@dataclasses.dataclass
class _Prepared:
    """A method built and warmed up: its runner, the draft model it drafts with (a checkpoint or a
    layer-skip view; None for other drafters and peers) and its rows' memory estimate."""

    runner: Runner
    draft_model: object = None
    kv_estimate_bytes: int | None = None
    own_loop: bool = False  # beam search or an approximate mode (decode.engine.own)


def _prepare_method(spec: str, model, tok, prompts, method: Method, warmup: int) -> _Prepared:
    """Build the method and warm it up."""
    if method.drafter is None:
        if llamacpp.is_llamacpp(spec):
            eos = _eos_ids(model.generation_config.eos_token_id)
            threads = int(parse_method(spec)[1].get("threads", 0)) or torch_default()
            return _Prepared(Runner(llamacpp.prepare(spec, str(model.name_or_path), prompts, method.options, eos, threads, warmup),
                                    len(prompts)))
        return _Prepared(_prepare_peer(spec, model, tok, prompts, method.options, warmup))
    opts = method.options

    def build():
        drafter = method.drafter.build(model, tok, opts)
        if isinstance(drafter, OwnLoop) or opts.sampling.beams > 1:  # a loop of its own: nothing drafts to time
            engine = build_engine(model, tok, opts, drafter)
            return engine, engine, None
        timed = _TimedPropose(drafter)
        drafter.propose = timed  # instance attribute: the engine calls it like the method
        return build_engine(model, tok, opts, drafter), drafter, timed

    # every timed pass starts from a drafter (and engine) that has seen nothing: not the warm-up, not an
    # earlier pass (copying and retrieval from the job's outputs, learned tables, online updates and
    # calibrations would otherwise read the answers to the same prompts); frozen weights are loaded once
    built: dict = {}

    def fresh():
        built["engine"], built["drafter"], built["timed"] = build()
        return built["timed"]

    fresh()
    engine, drafter = built["engine"], built["drafter"]
    bs, new_tokens = max(1, opts.scheduling.batch_size), opts.sampling.max_new_tokens
    compiled = engine.compile != "off"  # the engine resolved auto for its device
    # rows per prompt: its samples, or one where the method makes a prompt's outputs itself
    n = 1 if engine.expands_samples else opts.sampling.first_finish or opts.sampling.num_samples
    warm = prompts[:warmup]
    # compiled steps compile once per shape (segment bucket, buffer capacity, batch size): warming up at
    # the full length on prompts from the shortest to the longest meets the capacities the timed passes
    # will (a dimension seen at two sizes is compiled as dynamic), so compilation is not timed
    warm_tokens = new_tokens if compiled else min(16, new_tokens)
    if compiled and warmup:
        warm = spread_by_length(prompts, warmup)
    # ``+threads=N`` holds the method at N intra-op threads while it runs (the others keep the run's setting);
    # ``+weights=float32`` has a GGUF target's layers read their float32 weights, not the file's blocks
    @contextlib.contextmanager
    def pinned():
        with held(opts.placement.threads) if opts.placement.threads > 0 else contextlib.nullcontext(), \
                blocks.suspended(model, opts.placement.weights == "float32"):
            yield
    with pinned():
        for i in range(0, len(warm), bs):
            engine.generate(_sample_requests(warm, i, min(i + bs, len(warm)), warm_tokens, n))

    first_finish = opts.sampling.first_finish > 0

    def decode(lo: int, hi: int) -> list:
        out = []
        with pinned():
            for i in range(lo, hi, bs):
                t0 = time.perf_counter()
                res = built["engine"].generate(_sample_requests(prompts, i, min(i + bs, hi), new_tokens, n))
                wall = time.perf_counter() - t0
                out += [_joined(res[j : j + n], wall * n / len(res), first_finish) for j in range(0, len(res), n)]
        return out

    if isinstance(engine, OwnLoop):  # the memory model knows the speculative engine's buffers only
        return _Prepared(Runner(decode, len(prompts), fresh=fresh), engine.model, None, own_loop=True)
    # the model's estimate for one batch of rows at the run's longest prompt (weights excluded: they are shared)
    mm = memory_model(model, drafter, max(map(len, prompts)), new_tokens)
    estimate = min(bs, len(prompts)) * n * mm.row_bytes(draft_width(drafter, engine.num_draft))
    return _Prepared(Runner(decode, len(prompts), fresh=fresh), drafter.model, estimate)


def spread_by_length(prompts: list, k: int) -> list:
    """``k`` of the prompts at evenly spaced ranks of length, the shortest and the longest among them."""
    ranked = sorted(prompts, key=len)
    if k >= len(ranked):
        return ranked
    if k == 1:
        return [ranked[-1]]
    return [ranked[round(i * (len(ranked) - 1) / (k - 1))] for i in range(k)]


def _sample_requests(prompts, lo: int, hi: int, new_tokens: int, n: int) -> list[GenRequest]:
    """Prompts ``lo..hi`` as requests, each prompt's ``n`` samples adjacent rows of one group."""
    return [GenRequest(prompts[i], new_tokens, group=i if n > 1 else None) for i in range(lo, hi) for _ in range(n)]


def _joined(results: list, wall: float, first_finish: bool = False) -> tuple[list[int], dict]:
    """One prompt's outputs (its samples, or a method's several outputs of one request) as its output:
    their tokens one after another, their counters summed. With First Finish Search, the winner's tokens
    (``decode.jobs.job``'s choice) and every sample's counters: the work all of them cost."""
    if first_finish:
        finished = [r for r in results if r.finish_reason == "stop"]
        won = min(finished, key=lambda r: len(r.token_ids)) if finished else results[0]
        return won.token_ids, {**_joined(results, wall)[1], "new_tokens": len(won.token_ids), "first_tokens": won.token_ids}
    first = results[0].token_ids
    results = [r for res in results for r in (res, *res.alternatives)]
    if len(results) == 1:
        return results[0].token_ids, {**results[0].stats, "wall_s": wall}
    stats: dict = {}
    for res in results:
        for key, value in res.stats.items():
            if isinstance(value, list):
                add_counts(stats.setdefault(key, []), value)
            elif isinstance(value, dict):  # counters by a key (verify_widths)
                merged = stats.setdefault(key, {})
                for k, v in value.items():
                    merged[k] = merged.get(k, 0) + v
            elif isinstance(value, (int, float)) and not key.endswith("wall_s"):
                stats[key] = stats.get(key, 0) + value
    # the first output (sample 0, the best beam or draft) is what agreement and task scores read
    return [t for res in results for t in res.token_ids], {**stats, "wall_s": wall, "first_tokens": first}


class _PeakMemory:
    """Wraps a runner's ``decode``: on CUDA, the most memory allocated during any of its timed chunks
    (the peak counter is reset before each, so interleaved methods do not see each other's peaks)."""

    def __init__(self, runner: Runner, device):
        self.inner, self.device, self.peak = runner.decode, torch.device(device), None
        runner.decode = self

    def __call__(self, lo: int, hi: int) -> list:
        if self.device.type != "cuda":
            return self.inner(lo, hi)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = self.inner(lo, hi)
        self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated(self.device))
        return out

    def mib(self) -> float | None:
        return None if self.peak is None else round(self.peak / (1 << 20), 1)


def peak_rss_mib() -> float:
    """This process's peak resident set so far: ru_maxrss is KiB on Linux, bytes on macOS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1 << 20) if sys.platform == "darwin" else rss / 1024, 1)


class _TimedPropose:
    def __init__(self, drafter):
        self.inner = drafter.propose
        self.reset()

    def reset(self):
        self.seconds, self.calls = 0.0, 0

    def __call__(self, batch):
        t0 = time.perf_counter()
        out = self.inner(batch)
        if batch.device.type == "cuda":  # the drafting kernels' time, not their launch (the round syncs anyway)
            torch.cuda.synchronize(batch.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


PEERS = ("hf-generate", "hf-lookup", "hf-assisted")


def _eos_ids(eos) -> set[int]:
    """A generation config's end-of-output id (one, several or none) as a set."""
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def is_peer(spec: str) -> bool:
    """A spec run by another tool (transformers' generate, llama.cpp), not by specdec's engine."""
    return spec.startswith("hf-") or llamacpp.is_llamacpp(spec)


def _check_peer(spec: str) -> tuple[str, str, int]:
    """(peer, its argument, threads) of a peer spec; a ``UsageError`` for one that names none."""
    head, overrides = parse_method(spec)
    unknown = set(overrides) - {"threads"}
    if unknown:
        raise UsageError(f"{spec}: transformers' peers take only +threads=N, not {', '.join(sorted(unknown))}")
    try:
        threads = int(overrides.get("threads", 0))
    except ValueError:
        raise UsageError(f"{spec}: +threads=N takes a number of threads") from None
    name, _, arg = head.partition(":")
    if name not in PEERS:
        raise UsageError(f"unknown peer {spec!r} (hf-generate, hf-lookup, hf-assisted:DIR)")
    if name == "hf-assisted" and not arg:
        raise UsageError("hf-assisted needs a draft: hf-assisted:DIR")
    return name, arg, threads


def _prepare_peer(spec: str, model, tok, prompts, base: DecodeOptions, warmup: int) -> Runner:
    """transformers' own generate: hf-generate (plain; batched, left-padded, at the bench's batch size),
    hf-lookup (prompt lookup) and hf-assisted:DRAFT (one row at a time: transformers takes no more). A peer
    runs with torch's own intra-op thread count, as a transformers user gets it (``+threads=N`` sets it)."""
    name, arg, threads = _check_peer(spec)
    peer_threads = threads or torch_default()
    kwargs = {"do_sample": False, "pad_token_id": tok.pad_token_id, "eos_token_id": model.generation_config.eos_token_id}
    if base.sampling.temperature > 0:
        kwargs.update(do_sample=True, temperature=base.sampling.temperature)
    if name == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif name == "hf-assisted":
        kwargs["assistant_model"] = load_draft(resolve_member(arg), base.placement, device=input_device(model), dtype=model.dtype)

    def one(p, n):
        ids = torch.tensor([p], device=model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kwargs)
        return out[0, len(p) :].tolist()

    eos = _eos_ids(kwargs["eos_token_id"])

    def batched(ps, n):
        """Plain generate over a left-padded batch (prompt lookup and assisted generation take one row);
        each row's tokens up to its end of text, as ours are."""
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        width = max(map(len, ps))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, **kwargs)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    bs = max(1, base.scheduling.batch_size) if name == "hf-generate" else 1
    for p in prompts[:warmup]:
        one(p, 16)

    def decode(lo: int, hi: int) -> list:
        out = []
        ours = torch.get_num_threads()
        torch.set_num_threads(peer_threads)
        try:
            for i in range(lo, hi, bs):
                chunk = prompts[i : min(i + bs, hi)]
                t0 = time.perf_counter()
                outs = [one(chunk[0], base.sampling.max_new_tokens)] if len(chunk) == 1 else batched(chunk, base.sampling.max_new_tokens)
                wall = (time.perf_counter() - t0) / len(chunk)
                out += [(toks, {"new_tokens": len(toks), "wall_s": wall}) for toks in outs]
        finally:
            torch.set_num_threads(ours)
        return out

    return Runner(decode, len(prompts))


# -- measuring forward costs --------------------------------------------------------------------


class _ForwardCosts:
    """Median wall time of target forwards of T tokens over a typical cache, memoised by T, timed as the
    engine runs them (its output layer's greedy or exact path: ``models.head``)."""

    def __init__(self, model, prompts, repeats: int = 15, greedy: bool = True):
        self.model, self.repeats, self.greedy = model, repeats, greedy
        self.prefix = prompts[0][:128]
        self._memo: dict[int, float] = {}

    def __call__(self, t: int, model=None) -> float:
        model = model or self.model
        key = (id(model), t)
        if key not in self._memo:
            self._memo[key] = time_forward(model, self.prefix, t, self.repeats, greedy=self.greedy)
        return self._memo[key]


# -- the report -----------------------------------------------------------------------------------


def _one_row_per_prompt(options: DecodeOptions, prepared: "_Prepared") -> bool:
    """Whether a method decodes each prompt as one row of the speculative engine: what the ideal speedup and the
    roofline model (several samples, beams and loops of their own are not)."""
    sampling = options.sampling
    return sampling.num_samples == 1 and not sampling.first_finish and sampling.beams == 1 and not prepared.own_loop


def _entry(spec, run: Run, ar: Run, categories, costs, draft_model, base: DecodeOptions, tasks=None, tokenizer=None,
           own_row: bool = True) -> dict:
    """A method's report entry. ``tasks``: (prompt, record fields) per prompt where some records carry an
    ``answer`` (``bench.quality``), else None."""

    def summarize(idx: list[int]) -> dict:
        toks = sum(len(run.outputs[i]) for i in idx)
        calls = [run.stats[i].get("target_calls") for i in idx]
        ratio = speedup(run, ar, idx)
        out = {
            "prompts": len(idx),
            "new_tokens": toks,
            "tokens_per_s": round(tokens_per_s(run, idx), 2),
            "speedup": None if ratio is None else round(ratio, 3),
            "identical_to_ar": round(sum(run.outputs[i] == ar.outputs[i] for i in idx) / len(idx), 4)
            if base.sampling.temperature == 0 else None,
            "distinct4": round(distinct_ngram_ratio([run.outputs[i] for i in idx]), 4),
        }
        # a prompt's several outputs (samples, beams, drafts) are judged by the first
        first = [run.stats[i].get("first_tokens", run.outputs[i]) for i in idx]
        if base.sampling.temperature == 0:  # how far an output strays from plain greedy decoding's
            pairs = [diffusion_bench.token_agreement(f, ar.stats[i].get("first_tokens", ar.outputs[i])) for f, i in zip(first, idx)]
            out["token_agreement"] = round(sum(m for m, _ in pairs) / max(sum(c for _, c in pairs), 1), 4)
        if tasks is not None:  # checkable tasks: each output scored against the record's answer
            out.update(quality.summarise([quality.score(tasks[i][0], tokenizer.decode(f, skip_special_tokens=True), tasks[i][1])
                                          for f, i in zip(first, idx)]))
        if all(c is not None for c in calls):
            out["target_calls"] = sum(calls)
            out["tau"] = round(toks / sum(calls), 3) if sum(calls) else None
            drafted, accepted = _positions(run.stats, idx)
            out["acceptance_by_position"] = [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)]
        else:
            out["target_calls"] = out["tau"] = None
            out["acceptance_by_position"] = []
        return out

    # the headline is the same summary over every prompt: one way to compute a speedup, for a category or all
    # a spec's paths as the command shows them ($SPECDEC_HOME/...), not where this machine keeps its home
    entry = {"method": shown_home(spec), **summarize(list(range(len(run.outputs)))), "walls_s": [round(w, 4) for w in run.walls]}
    if any(st.get("approximate") for st in run.stats):
        entry["approximate"] = True
    for name in ("target_cache_bytes", "draft_cache_bytes"):  # key/value memory: the largest any batch held
        held = max((st.get(name) or 0 for st in run.stats), default=0)
        if held:
            entry[name.replace("_bytes", "_mb")] = round(held / 2**20, 2)
    if any(t is not None for t in run.pass_taus):
        entry["tau_by_pass"] = run.pass_taus  # equal in every pass at T=0: no pass learns from another
    if own_row:
        entry.update(_ideal(spec, run, entry, costs, draft_model))
    else:  # several rows or outputs per prompt: a round's costs and the counters are not one row's
        entry.update(ideal_speedup=None, efficiency=None)
    cats = sorted(set(categories))
    if len(cats) > 1 or cats != ["all"]:
        entry["by_category"] = {c: summarize([i for i, k in enumerate(categories) if k == c]) for c in cats}
    return entry


def _positions(stats, idx):
    drafted, accepted = [], []
    for i in idx:
        for name, acc in (("position_drafted", drafted), ("position_accepted", accepted)):
            add_counts(acc, stats[i].get(name, []))
    return drafted, accepted


def _in_target(spec: str) -> bool:
    named = _named(spec)
    return named is not None and named.in_target


def _named(spec: str):
    """The registry's factory of a spec's drafter, where a name selects it (``ngram+max-ngram=2``: ngram's)."""
    return named_factory(parse_method(spec)[0])


def _ideal(spec, run: Run, entry: dict, costs, draft_model) -> dict:
    tau = entry.get("tau")
    if is_peer(spec) or not tau or run.rounds == 0 or _in_target(spec):
        return {"ideal_speedup": None, "efficiency": None} if spec != "ar" else {"ideal_speedup": 1.0, "efficiency": entry["speedup"]}
    rounds = sum(s.get("target_calls", 0) for s in run.stats) - len(run.stats)  # minus prefills
    drafted = sum(s.get("drafted_tokens", 0) for s in run.stats)
    t1 = costs(1)
    widths: dict[int, int] = {}
    for s in run.stats:  # the verify forwards by width: their costs, not the cost at their mean width
        for w, n in (s.get("verify_widths") or {}).items():
            widths[int(w)] = widths.get(int(w), 0) + n
    if widths:
        v = sum(n * costs(w) for w, n in widths.items()) / sum(widths.values()) / t1
    else:
        v = costs(1 + round(drafted / max(rounds, 1))) / t1
    c_round = _draft_cost_per_round(spec, run, costs, draft_model, drafted / max(rounds, 1)) / t1
    ideal = tau / (c_round + v)
    return {"ideal_speedup": round(ideal, 3), "efficiency": round(entry["speedup"] / ideal, 3), "verify_cost": round(v, 3), "draft_cost": round(c_round, 3)}


def _draft_cost_per_round(spec, run: Run, costs, draft_model, drafts_per_round: float) -> float:
    """Seconds of drafting per round: one draft-model forward per token a row drafts in a round
    (``drafts_per_round``: per row, as the verify width is; a batch's rows share each draft forward),
    measured propose time for neural heads, zero for model-free drafters (``Factory.model_free``: their
    host time is implementation overhead)."""
    named = _named(spec)
    if named is not None and named.model_free:
        return 0.0
    if draft_model is not None:
        return drafts_per_round * costs(1, draft_model)
    return run.propose_s / max(run.rounds, 1)


# -- rendering ------------------------------------------------------------------------------------


def render(report: dict, console, json_path: str | None = None, plot_path: str | None = None) -> None:
    console.print(diffusion_bench.render_table(report) if report.get("kind") == "diffusion" else table(report))
    for path in filter(None, (plot_path, json_path)):
        Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    if plot_path:
        plot(report, plot_path)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=2)
        console.print(f"report written to {json_path}")


def table(report: dict):
    from rich.console import Group
    from rich.table import Table

    cfg = report["config"]
    fmt = lambda v, p=2: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    main = Table(title=f"specdec bench: {cfg['prompts']} prompts, {cfg['max_new_tokens']} new tokens, T={cfg['temperature']}, bs={cfg['batch_size']}")
    scored = [k for k in ("list_exact", "code_exact", "code_parses") if any(k in m for m in report["methods"])]
    for col in ("method", "tok/s", "speedup", "tau", "same as ar", "agree", "distinct4", "ideal", "effic.", "calls", "GB/s", "% peak",
                "peak MiB", "KV est. MiB", *scored):
        main.add_column(col, justify="left" if col == "method" else "right", overflow="fold")
    for m in report["methods"]:
        main.add_row(
            m["method"] + (" (approx.)" if m.get("approximate") else ""), fmt(m["tokens_per_s"], 1), fmt(m["speedup"]), fmt(m.get("tau")),
            fmt(m.get("identical_to_ar")), fmt(m.get("token_agreement")), fmt(m["distinct4"], 3), fmt(m.get("ideal_speedup")), fmt(m.get("efficiency")), fmt(m.get("target_calls")),
            fmt(m.get("achieved_gbps"), 1), "-" if m.get("peak_fraction") is None else f"{100 * m['peak_fraction']:.1f}",
            fmt(m.get("peak_mib"), 1), fmt(m.get("kv_estimate_mib"), 2), *[fmt(m.get(k)) for k in scored],
        )
    if cfg.get("peak_rss_mib") is not None:
        main.caption = f"process peak RSS {cfg['peak_rss_mib']} MiB; KV est. = decode.jobs.memory's estimate for one batch of rows, not measured"
    parts = [main]
    depth = max((len(m.get("acceptance_by_position", [])) for m in report["methods"]), default=0)
    if depth:
        acc = Table(title="acceptance by draft position (P(accepted | earlier accepted))")
        acc.add_column("method", overflow="fold")
        for i in range(min(depth, 8)):
            acc.add_column(str(i + 1), justify="right")
        for m in report["methods"]:
            vals = m.get("acceptance_by_position", [])
            if vals:
                acc.add_row(m["method"], *[f"{v:.2f}" for v in vals[:8]] + [""] * (min(depth, 8) - len(vals[:8])))
        parts.append(acc)
    cats = sorted({c for m in report["methods"] for c in m.get("by_category", {})})
    if cats:
        per = Table(title="by category: speedup / tau")
        per.add_column("method", overflow="fold")
        for c in cats:
            per.add_column(c, justify="right")
        for m in report["methods"]:
            per.add_row(m["method"], *[
                f"{fmt(m.get('by_category', {}).get(c, {}).get('speedup'))} / {fmt(m.get('by_category', {}).get(c, {}).get('tau'))}"
                for c in cats
            ])
        parts.append(per)
    return Group(*parts)
