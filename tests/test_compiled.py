"""Compiled decode steps (``--compile``): preallocated key/value buffers, segments padded to bucketed
lengths, the capacity grown and rows copied as the batch changes. Greedy output stays token-identical to
plain decoding for chains, trees, hidden-state drafters and continuous batching; sampling keeps the
target's distribution.

The compiler backend is ``aot_eager`` here: it captures and partitions the same graphs inductor would
compile (graph breaks and guards included), without spending a minute per shape generating C++."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from test_architectures import EOS, NEW, PROMPTS, build
from test_continuous import BATCH, BUDGETS, make_drafter
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.engine import compiled
from specdec.decode.engine import cache as cache_module
from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import RecycleDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling


@pytest.fixture(autouse=True)
def quick_backend(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    # small capacity steps: buffers grow (and are copied) several times within one request
    monkeypatch.setattr(cache_module, "CAPACITY_STEP", 16)
    compiled._COMPILED.clear()
    yield
    compiled._COMPILED.clear()


@pytest.fixture()
def calls(monkeypatch):
    """How many forwards ran through a compiled module (so a test fails if nothing was compiled)."""
    counts = {"compiled": 0, "with_prefix": 0}

    def counted(cls):
        make = cls.__init__

        def counting(self, model, *args):
            make(self, model, *args)
            inner = self.forward

            def forward(*args, **kwargs):
                counts["compiled"] += 1
                counts["with_prefix"] += "shared_prefix" in kwargs
                return inner(*args, **kwargs)

            self.forward = forward

        monkeypatch.setattr(cls, "__init__", counting)

    counted(compiled.Compiled)
    counted(compiled.Graphed)
    return counts


# both compiled modes: torch.compile (aot_eager here) and recorded graphs (on a CPU each "replay" runs the
# recorded step function over the same static input copies, so keys, copies and outputs are what is tested)
MODES = pytest.mark.parametrize("mode", ["inductor", "graphs"])


def test_bucket_and_capacity():
    assert [compiled.bucket(t) for t in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert compiled.bucket(65) is None  # prefills run eagerly
    assert cache_module.capacity_for(1) == 16 and cache_module.capacity_for(16) == 16 and cache_module.capacity_for(17) == 32


@MODES
def test_compiled_state_matches_eager_forward(target, mode):
    """The same segments through both states: logits agree, and the compiled state's buffers hold
    exactly the committed keys and values of the eager one (rollback and gather included)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 96, (2, 9))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    states = [KVState(target, 2, ids.device), KVState(target, 2, ids.device, compile=mode)]
    outs = [s.forward(ids, valid).logits for s in states]
    torch.testing.assert_close(outs[0], outs[1])
    for s in states:
        s.commit_prefix(9, valid)
    step = torch.randint(3, 96, (2, 5))
    outs = [s.forward(step).logits for s in states]  # 5 tokens run as a padded bucket of 8
    assert outs[1].shape == outs[0].shape
    torch.testing.assert_close(outs[0], outs[1])
    keep = torch.tensor([[True, True, True], [True, False, False]])
    for s in states:
        s.commit_prefix(3, keep)
        s.rollback(3, [2, 1])
    assert states[0].length == states[1].length
    for (k0, v0), (k1, v1) in zip(states[0]._committed(), states[1]._committed()):
        torch.testing.assert_close(k0, k1)
        torch.testing.assert_close(v0, v1)
    assert states[1].cache.capacity >= states[1].length


@MODES
@pytest.mark.parametrize("name", ["ar", "draft", "recycle", "eagle-dynamic"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_compiled_is_plain_greedy(target, draft_model, calls, name, bsz, mode):
    prompts = make_prompts(bsz, seed=11, lo=3, hi=35)
    budgets = [30, 7, 19][:bsz]
    reqs = [GenRequest(p, n) for p, n in zip(prompts, budgets)]
    plain = SpecEngine(target, ByteTokenizer()).generate(reqs)
    fast = SpecEngine(target, ByteTokenizer(), make_drafter(name, target, draft_model), compile=mode).generate(reqs)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert calls["compiled"] > 0


@MODES
def test_continuous_batching_compiled(target, draft_model, calls, mode):
    """Rows admitted into a running batch and finished rows dropped: buffers are rebuilt for the new
    rows each time, and every output still equals decoding the request alone."""
    prompts = make_prompts(len(BUDGETS), seed=5, lo=3, hi=40)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, BUDGETS)]
    alone = [SpecEngine(target, ByteTokenizer()).generate([r])[0] for r in reqs]
    engine = SpecEngine(target, ByteTokenizer(), make_drafter("draft", target, draft_model), compile=mode)
    got = dict(engine.stream(iter(reqs), BATCH))
    assert [got[i].token_ids for i in range(len(reqs))] == [r.token_ids for r in alone]
    assert calls["compiled"] > 0


@pytest.mark.parametrize("chunk", [0, 4])
def test_continuous_batching_compiled_with_rows_joining_by_chunks(target, draft_model, calls, chunk):
    """Compiled verify steps while admitted prompts ride eager forwards a chunk a round (or are prefilled
    on their own): the outputs are those of each request decoded alone."""
    prompts = make_prompts(len(BUDGETS), seed=5, lo=3, hi=40)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, BUDGETS)]
    alone = [SpecEngine(target, ByteTokenizer()).generate([r])[0] for r in reqs]
    engine = SpecEngine(target, ByteTokenizer(), make_drafter("ngram", target, draft_model), compile="inductor", prefill_chunk=chunk)
    got = dict(engine.stream(iter(reqs), BATCH))
    assert [got[i].token_ids for i in range(len(reqs))] == [r.token_ids for r in alone]
    assert calls["compiled"] > 0


@MODES
def test_a_prefix_held_once_runs_compiled(target, draft_model, calls, monkeypatch, mode):
    """Compiled steps whose rows hold only their suffixes: the prefix held once enters every compiled
    forward's attention, and greedy output is that of whole prompts, in static and continuous batches."""
    from test_shared_prefix import _prompts

    from specdec.decode.engine import hydragen

    _, prompts = _prompts(5)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [9, 3, 14, 6, 11])]
    whole = [r.token_ids for r in SpecEngine(target, ByteTokenizer()).generate(reqs)]
    held = {"calls": 0}
    original = hydragen.prefix_suffix_attention

    def counting(*args, **kwargs):
        held["calls"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(hydragen, "prefix_suffix_attention", counting)
    engine = SpecEngine(target, ByteTokenizer(), ModelDrafter(draft_model), shared_prefix="auto", min_shared=8, compile=mode)
    assert [r.token_ids for r in engine.generate(reqs[:3]) + engine.generate(reqs[3:])] == whole
    got = dict(engine.stream(iter(reqs), 2))
    assert [got[i].token_ids for i in range(len(reqs))] == whole
    assert engine._hydragen() and held["calls"] > 0 and calls["with_prefix"] > 0


@MODES
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gpt2"])
def test_other_architectures_compiled(calls, arch, mode):
    """An all-sliding model, a hybrid one (one mask per layer type, Gemma-2's soft-capping) and GPT-2's
    learned positions: the window lives in the mask, which spans the whole buffer."""
    model = build(arch)
    reqs = [GenRequest(p, NEW) for p in PROMPTS]
    plain = SpecEngine(model, ByteTokenizer(), eos_ids=[EOS]).generate(reqs)
    fast = SpecEngine(model, ByteTokenizer(), RecycleDrafter(), eos_ids=[EOS], compile=mode).generate(reqs)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert calls["compiled"] > 0


@MODES
def test_sampling_compiled_keeps_the_target_distribution(calls, mode):
    """T=0.8 with a draft model and compiled steps: the first two tokens' joint frequencies match the
    target's exact joint distribution (chi-square over many rows of one batch)."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # many tokens matter
    drafter = ModelDrafter(tiny_llama(vocab=vocab, hidden=32, layers=1, seed=4))
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[], compile=mode)
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0
    assert calls["compiled"] > 0


def test_decode_cli_compile(tmp_path, tiny_family):
    """``decode --compile`` writes the same completions as eager decoding."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "def f{i}(x):"}}\n' for i in range(3)))
    outs = []
    for flag in ([], ["--compile", "inductor"]):
        out = tmp_path / f"out{len(flag)}.jsonl"
        res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(tiny_family / "target"),
                      "--drafter", "ngram", "--max-new-tokens", "12", *flag])
        assert res.exit_code == 0, res.output
        outs.append(out.read_text().splitlines())
    assert [json.loads(x)["completion"] for x in outs[0]] == [json.loads(x)["completion"] for x in outs[1]]


def test_a_small_draft_keeps_its_lean_forward_on_a_cpu(target):
    """On a CPU a draft's plain-function forward is cheaper per call than a compiled graph: lean wins
    there, and a model lean cannot run still compiles."""
    cpu = torch.device("cpu")
    draft = tiny_llama(seed=1, layers=1, hidden=32)  # its own: other tests hook or re-point the shared ones
    draft_state = KVState(draft, 2, cpu, lean=True, compile="inductor")
    assert draft_state._lean is not None and draft_state._compiled is None
    target_state = KVState(target, 2, cpu, compile="inductor")
    assert target_state._lean is None and target_state._compiled is not None


def test_graphs_record_once_per_shape_and_buffers(target):
    """A step is recorded once per key (shapes, flags, buffer addresses) and replayed after: a second
    step of the same bucket over the same buffers records nothing, a new bucket or new buffers do."""
    torch.manual_seed(1)
    state = KVState(target, 2, torch.device("cpu"), compile="graphs")
    graphed = state._compiled
    prompt = torch.randint(3, 96, (2, 20))
    state.forward(prompt)  # the first forward allocates the buffers: run as it is, nothing recorded
    state.commit_prefix(20, torch.ones_like(prompt, dtype=torch.bool))
    assert graphed.recorded == 0
    for t in (1, 1, 3, 4, 1):  # buckets 1, 1, 4, 4, 1
        step = torch.randint(3, 96, (2, t))
        state.forward(step)
        state.commit_prefix(t, torch.ones_like(step, dtype=torch.bool))
    assert graphed.recorded == 2 and graphed.replays == 5
    state._reserve(state.cache.capacity + 1)  # grown: new buffers, new addresses
    state.forward(torch.randint(3, 96, (2, 1)))
    assert graphed.recorded == 3


def test_graphs_die_with_their_buffers(target):
    """A cache's recorded steps are dropped with it: nothing they keep holds the buffers, so a batch's key/value
    memory (and on a GPU its graphs) goes when the batch does."""
    import gc
    import weakref

    state = KVState(target, 1, torch.device("cpu"), compile="graphs")
    prompt = torch.randint(3, 96, (1, 12))
    state.forward(prompt)
    state.commit_prefix(12, torch.ones_like(prompt, dtype=torch.bool))
    out = state.forward(torch.randint(3, 96, (1, 1)))
    assert state._compiled.recorded == 1 and out.past_key_values is state.cache
    old = weakref.ref(state.cache)
    del out
    state._reserve(state.cache.capacity + 1)  # new buffers: the old ones are no longer the state's
    gc.collect()
    assert old() is None and len(state._compiled._steps) == 0


def test_graphs_leave_hooked_forwards_unrecorded(target):
    """A forward hook's per-call tensors (the riding drafters' columns) would be frozen into a recorded
    graph: while one is registered, steps run as they are, and the hook sees every one of them."""
    torch.manual_seed(2)
    state = KVState(target, 1, torch.device("cpu"), compile="graphs")
    graphed = state._compiled
    prompt = torch.randint(3, 96, (1, 12))
    state.forward(prompt)
    state.commit_prefix(12, torch.ones_like(prompt, dtype=torch.bool))
    seen = []
    handle = target.get_input_embeddings().register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    try:
        for _ in range(3):
            step = torch.randint(3, 96, (1, 1))
            state.forward(step)
            state.commit_prefix(1, torch.ones_like(step, dtype=torch.bool))
    finally:
        handle.remove()
    assert graphed.recorded == 0 and len(seen) == 3
    # transformers installs its output-capturing hooks at the first forward that asks for hidden states;
    # they collect outputs for the output object and are recorded with the step
    for t in (1, 2):
        step = torch.randint(3, 96, (1, t))
        state.forward(step, hidden=True)
        state.commit_prefix(t, torch.ones_like(step, dtype=torch.bool))
    assert graphed.recorded == 2


def test_graphs_need_a_cuda_device(tmp_path, tiny_family):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "def f(x):"}\n')
    res = invoke(["decode", "--in", str(src), "--out", str(tmp_path / "o.jsonl"), "--target", str(tiny_family / "target"),
                  "--device", "cpu", "--compile", "graphs"])
    assert res.exit_code == 2 and "--compile graphs records CUDA graphs" in res.output
    res = invoke(["decode", "--in", str(src), "--out", str(tmp_path / "o.jsonl"), "--target", str(tiny_family / "target"),
                  "--compile", "fast"])
    assert res.exit_code == 2 and "--compile must be one of" in res.output
