"""Continuous batching: rows join a running batch as others finish. Greedy decoding with every drafter
stays token-identical to plain decoding of each request on its own; sampling still draws from the
target's distribution with rows admitted mid-way (and a verifier that skips the residual fails that test)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from test_sampling import P_FLOOR, chi2_pvalue, exact_two_token_distribution

from specdec.decode.engine import loop as engine_module
from specdec.decode.engine.ride import Ride
from specdec.decode.drafters.adaptive import AdaptiveDrafter
from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.base import Drafter, NoDrafter
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import NgramDrafter, RecycleDrafter
from specdec.decode.drafters.self_speculation import layer_skip_view
from specdec.decode.drafters.trimmed import TrimmedDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.drafters.heads import DRAFTERS
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling, Verdict, logits_to_probs, sample_from, verify_chain
from specdec.models.acceptance import N_STATS, AcceptanceHead
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.head_artifacts import build_heads

# very different budgets (2..40) and prompt lengths (3..40), more requests than the batch holds
BUDGETS = [2, 40, 7, 13, 31, 3, 25, 18, 9]
BATCH = 3


@pytest.fixture(scope="module")
def reqs():
    prompts = make_prompts(len(BUDGETS), seed=5, lo=3, hi=40)
    return [GenRequest(p, n) for p, n in zip(prompts, BUDGETS)]


@pytest.fixture(scope="module")
def alone(target, reqs):
    """Plain ``ar`` decoding of each request on its own."""
    return [SpecEngine(target, ByteTokenizer()).generate([r])[0] for r in reqs]


def _acceptance_head(hidden: int):
    torch.manual_seed(3)
    head = AcceptanceHead(hidden + N_STATS).double()
    with torch.no_grad():  # a confidence that varies with the hidden state: rows stop at different lengths
        head.out.weight.normal_(0, 0.3)
        head.out.weight[:, -N_STATS:] = 0.0
        head.out.bias.fill_(2.0)
    return head.eval()


def _heads(kind, target):
    torch.manual_seed(0)
    return build_heads(kind, target, {"window": 16}).attach(target, init_from_lm_head=True).double().eval()


def make_drafter(name, target, draft_model):
    if name in ("medusa", "clover", "eagle-static", "eagle-dynamic"):
        kind, _, tree = name.partition("-")
        return DRAFTERS[kind](_heads(kind, target), target, tree=tree or "static", tree_tokens=10, top_k=3)
    return {
        "ar": NoDrafter,
        "ngram": NgramDrafter,
        "recycle": RecycleDrafter,
        "layerskip": lambda: ModelDrafter(layer_skip_view(target, [1])),
        "trimmed": lambda: TrimmedDrafter(target, torch.arange(0, target.config.vocab_size, 2), NgramDrafter()),
        "draft": lambda: ModelDrafter(draft_model),
        "adaptive": lambda: AdaptiveDrafter(draft_model, _acceptance_head(draft_model.config.hidden_size), stop_threshold=0.7,
                                            min_draft=1, max_draft=6),
    }[name]()


NAMES = ["ar", "ngram", "recycle", "layerskip", "trimmed", "draft", "adaptive", "medusa", "clover", "eagle-static", "eagle-dynamic"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuous_equals_each_request_alone(target, draft_model, reqs, alone, name):
    engine = SpecEngine(target, ByteTokenizer(), make_drafter(name, target, draft_model))
    order, got = [], {}
    for i, res in engine.stream(iter(reqs), BATCH):  # an iterator: requests are read as rows free up
        order.append(i)
        got[i] = res
    assert sorted(order) == list(range(len(reqs)))
    assert order != sorted(order)  # short requests overtook long ones: rows really were admitted mid-way
    for i, ref in enumerate(alone):
        assert got[i].token_ids == ref.token_ids, (name, i)
        assert got[i].finish_reason == ref.finish_reason
    if name != "ar":
        assert sum(r.stats["drafted_tokens"] for r in got.values()) > 0


def _count_prefills(engine) -> list[int]:
    """How many prefill forwards of their own ``engine`` runs (a list, so the count can be read after)."""
    count, prefill = [0], engine._prefill

    def counted(*args):
        count[0] += 1
        return prefill(*args)

    engine._prefill = counted
    return count


@pytest.mark.parametrize("name", NAMES)
def test_greedy_rows_joining_by_chunks_equal_each_request_alone(target, draft_model, reqs, alone, name):
    """Admitted prompts prefilled a chunk a round inside the verify forwards (SARATHI): every drafter,
    trees and hidden-state readers included, still decodes each request as it decodes alone."""
    engine = SpecEngine(target, ByteTokenizer(), make_drafter(name, target, draft_model), prefill_chunk=5)
    prefills = _count_prefills(engine)
    got, order = {}, []
    for i, res in engine.stream(iter(reqs), BATCH):
        order.append(i)
        got[i] = res
    # the first batch, and another only if every row finished in one round with none joining
    assert prefills[0] <= 2
    assert order != sorted(order)
    for i, ref in enumerate(alone):
        assert (got[i].token_ids, got[i].finish_reason) == (ref.token_ids, ref.finish_reason), (name, i)


@pytest.mark.parametrize("chunk", [1, 64])
def test_chunks_narrower_and_wider_than_a_prompt(target, reqs, alone, chunk):
    """A chunk of one token (the verify width decides) and one wider than every prompt (one round)."""
    engine = SpecEngine(target, ByteTokenizer(), make_drafter("ngram", target, None), prefill_chunk=chunk)
    got = dict(engine.stream(iter(reqs), BATCH))
    assert [got[i].token_ids for i in range(len(reqs))] == [r.token_ids for r in alone]


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("name", ["draft", "clover", "eagle-dynamic"])
def test_rows_ending_at_their_first_token_or_at_eos(target, draft_model, name, chunk):
    """Budgets of one token (rows that end in their own prefill, sometimes the whole admission, so the
    batch empties and starts over) and an end-of-sequence token that stops rows mid-round."""
    prompts = make_prompts(8, seed=17, lo=3, hi=20)
    budgets = [1, 1, 12, 1, 1, 1, 20, 1]
    plain = [SpecEngine(target, ByteTokenizer(), eos_ids=[]).generate([GenRequest(p, 20)])[0].token_ids for p in prompts]
    eos = plain[2][5]  # a token some rows emit mid-way
    reqs = [GenRequest(p, n) for p, n in zip(prompts, budgets)]
    alone = [SpecEngine(target, ByteTokenizer(), eos_ids=[eos]).generate([r])[0] for r in reqs]
    assert any(r.finish_reason == "stop" and len(r.token_ids) > 1 for r in alone)
    engine = SpecEngine(target, ByteTokenizer(), make_drafter(name, target, draft_model), eos_ids=[eos], prefill_chunk=chunk)
    got = dict(engine.stream(reqs, 2))
    assert [(got[i].token_ids, got[i].finish_reason) for i in range(len(reqs))] == [(r.token_ids, r.finish_reason) for r in alone]


@pytest.mark.parametrize("chunk", [0, 6])
def test_admission_leaves_every_rows_cache_equal_to_a_fresh_prefill(target, draft_model, reqs, chunk):
    """After admissions into a running batch, each row's valid target-cache slots are exactly those
    of a fresh prefill of its text, at the positions of its text (rows joining by chunks too)."""
    engine = SpecEngine(target, ByteTokenizer(), ModelDrafter(draft_model), prefill_chunk=chunk)
    rounds, checked = [0], [0]
    verify = engine._verify

    def spy(state, batch, proposal, *joining):
        rounds[0] += 1
        if rounds[0] % 5 == 0:
            for row, seq in enumerate(batch.seqs):
                text = seq[: int(state.pos[row])]  # the root is not in the cache yet
                fresh = KVState(target, 1, torch.device("cpu"))
                fresh.forward(torch.tensor([text]))
                fresh.commit_prefix(len(text), torch.ones(1, len(text), dtype=torch.bool))
                keep = state.valid[row]
                assert state.positions[row][keep].tolist() == list(range(len(text)))
                for (got_k, got_v), (ref_k, ref_v) in zip(state._committed(), fresh._committed()):
                    torch.testing.assert_close(got_k[row][:, keep], ref_k[0], rtol=1e-9, atol=1e-9)
                    torch.testing.assert_close(got_v[row][:, keep], ref_v[0], rtol=1e-9, atol=1e-9)
                checked[0] += 1
        return verify(state, batch, proposal, *joining)

    engine._verify = spy
    finished = [i for i, _ in engine.stream(reqs, BATCH)]
    assert len(finished) == len(reqs) and checked[0] >= 10


@pytest.mark.parametrize("compile", ["off", "inductor"])
def test_rows_admitted_where_rows_finished_are_written_in_place(target, compile, monkeypatch):
    """Finished rows leave room in the buffers; rows admitted into it are written there, the running
    rows' keys and values neither copied nor moved (unless a row before them finished), and every row's
    next logits are those of its text alone."""
    from specdec.decode.engine import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    texts = make_prompts(4, seed=11, lo=6, hi=20)
    fresh_text = make_prompts(1, seed=12, lo=3, hi=5)[0]  # shorter than the running slots: fits in place
    width = max(map(len, texts))
    ids = torch.tensor([[0] * (width - len(t)) + t for t in texts])
    valid = torch.tensor([[False] * (width - len(t)) + [True] * len(t) for t in texts])
    state = KVState(target, 4, torch.device("cpu"), compile=compile)
    state.forward(ids, valid)
    state.commit_prefix(width, valid)
    store = state.cache.layers[0].store[0]
    state.select_rows(torch.tensor([0, 1, 3]))  # row 2 finished: row 3 moves down, rows 0 and 1 stay
    new = KVState(target, 1, torch.device("cpu"), compile=compile)
    new.forward(torch.tensor([fresh_text]))
    new.commit_prefix(len(fresh_text), torch.ones(1, len(fresh_text), dtype=torch.bool))
    state.admit(new)
    assert state.cache.layers[0].store[0] is store and state.cache.layers[0].keys.shape[0] == 4
    step = torch.tensor([[5], [6], [7], [8]])
    got = state.forward(step).logits[:, -1]
    for row, text in enumerate([texts[0], texts[1], texts[3], fresh_text]):
        alone = KVState(target, 1, torch.device("cpu"))
        want = alone.forward(torch.tensor([text + [5 + row]])).logits[0, -1]
        torch.testing.assert_close(got[row], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("compile", ["off", "inductor"])
def test_slots_only_finished_rows_used_leave_without_a_copy(target, compile, monkeypatch):
    """When the longest row finishes, the head slots no row keeps leave the slots every forward reads,
    the buffers unchanged and unmoved, and the rows left decode as their texts alone."""
    from specdec.decode.engine import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    long, short = make_prompts(1, seed=13, lo=20, hi=21)[0], make_prompts(1, seed=14, lo=6, hi=7)[0]
    width = len(long)
    ids = torch.tensor([long, [0] * (width - len(short)) + short])
    valid = torch.tensor([[True] * width, [False] * (width - len(short)) + [True] * len(short)])
    state = KVState(target, 2, torch.device("cpu"), compile=compile)
    state.forward(ids, valid)
    state.commit_prefix(width, valid)
    store = state.cache.layers[0].store[0]
    state.select_rows(torch.tensor([1]))
    assert state.length == len(short) and state.cache.offset == width - len(short)
    assert state.cache.layers[0].store[0] is store
    for step in ([5], [6, 7]):  # one token, then two, after the dropped head
        got = state.forward(torch.tensor([step])).logits[0, -1]
        state.commit_prefix(len(step), torch.ones(1, len(step), dtype=torch.bool))
        short = short + step
        alone = KVState(target, 1, torch.device("cpu"))
        torch.testing.assert_close(got, alone.forward(torch.tensor([short])).logits[0, -1], rtol=1e-9, atol=1e-9)


def test_sliding_window_hybrid_target_with_a_sliding_draft():
    """Admitted rows bring their slot positions along: sliding-window masks stay right per row."""
    common = dict(vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, hidden_size=32,
                  intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=8)
    models = []
    for seed, cfg in ((0, tf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)),
                      (1, tf.MistralConfig(num_hidden_layers=1, **common))):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg).double().eval()
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
        models.append(model)
    target, draft = models
    prompts = make_prompts(6, seed=9, lo=3, hi=24)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [30, 4, 17, 2, 26, 11])]
    alone = [SpecEngine(target, ByteTokenizer(), eos_ids=[]).generate([r])[0].token_ids for r in reqs]
    got = dict(SpecEngine(target, ByteTokenizer(), ModelDrafter(draft), eos_ids=[]).stream(reqs, 2))
    assert [got[i].token_ids for i in range(len(reqs))] == alone


def test_generate_is_static_and_stream_matches_it_per_request(target, reqs):
    engine = SpecEngine(target, ByteTokenizer(), NgramDrafter())
    static = engine.generate(reqs)
    assert all(r.stats["batch_wall_s"] == static[0].stats["batch_wall_s"] for r in static)
    streamed = dict(engine.stream(reqs, len(reqs)))  # everything admitted at once: the static batch
    assert [streamed[i].token_ids for i in range(len(reqs))] == [r.token_ids for r in static]
    assert engine.generate([]) == []


def test_a_drafter_without_admit_refuses_continuous_batching(target, reqs):
    class Stateful(Drafter):  # per-row state, no admit
        pass

    engine = SpecEngine(target, ByteTokenizer(), Stateful())
    with pytest.raises(SpecdecError, match="Stateful drafter cannot take new rows.*--schedule static"):
        engine.stream(reqs, BATCH)
    assert len(engine.generate(reqs[:2])) == 2  # one static batch never admits: it still decodes
    with pytest.raises(SpecdecError, match="cannot take new rows"):
        Stateful().admit(None, None)


# -- sampling ---------------------------------------------------------------------------------


def _no_residual_verify_chain(logits, tokens, draft_probs, sampling, generator, lengths=None, kernels="torch"):
    """The bug: after a rejection, resample from p instead of the residual max(p - q, 0)."""
    verdict = verify_chain(logits, tokens, draft_probs, sampling, generator, lengths, kernels)
    if sampling.greedy or tokens.shape[1] == 0:
        return verdict
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    p_at = logits_to_probs(logits[rows, verdict.accepted], sampling)
    u = torch.rand(tokens.shape[0], generator=generator, device=tokens.device)
    rejected = verdict.accepted < (tokens.shape[1] if lengths is None else lengths)
    next_token = torch.where(rejected, sample_from(p_at, u), verdict.next_token)
    return Verdict(verdict.accepted, verdict.path, next_token)


def _sampled_pairs(broken: bool, monkeypatch, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two sampled tokens after one prompt, each of those rows joining a running batch of rows that
    decode other prompts for other lengths (fillers), with a draft model (its own cache admitted too);
    with ``chunk``, the prompts join by chunks riding the verify forwards."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # many tokens matter
    if broken:
        monkeypatch.setattr(engine_module, "verify_chain", _no_residual_verify_chain)
    drafter = ModelDrafter(tiny_llama(vocab=vocab, hidden=32, layers=1, seed=4))
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[], prefill_chunk=chunk)
    prompt = [5, 7, 5, 7, 5]
    g = torch.Generator().manual_seed(0)
    reqs, probes = [], []
    for i in range(9000):
        if i % 3 == 2:
            n = int(torch.randint(3, 12, (1,), generator=g))
            reqs.append(GenRequest(torch.randint(3, vocab, (n,), generator=g).tolist(), int(torch.randint(1, 7, (1,), generator=g))))
        else:
            probes.append(len(reqs))
            reqs.append(GenRequest(prompt, 2))
    got = dict(engine.stream(reqs, 256))
    pairs = torch.tensor([got[i].token_ids[0] * vocab + got[i].token_ids[1] for i in probes])
    exact = exact_two_token_distribution(target, prompt, sampling)
    accepted = sum(r.stats["accepted_tokens"] for r in got.values())
    return torch.bincount(pairs, minlength=vocab * vocab).double(), exact.double(), accepted


def test_sampling_with_admission_draws_the_target_joint_distribution(monkeypatch):
    counts, exact, accepted = _sampled_pairs(False, monkeypatch)
    assert chi2_pvalue(counts, exact) > P_FLOOR
    assert accepted > 0  # drafts were actually tested


def test_sampling_with_rows_joining_by_chunks_draws_the_target_joint_distribution(monkeypatch):
    counts, exact, accepted = _sampled_pairs(False, monkeypatch, chunk=5)
    assert chi2_pvalue(counts, exact) > P_FLOOR
    assert accepted > 0


def test_a_joining_row_drawing_its_first_token_at_the_wrong_position_fails_the_same_test(monkeypatch):
    split = Ride.split

    def off_by_one(self, out, bsz):  # the bug: each chunk token's logits stand for the next one's
        out.logits[bsz:, 1:] = out.logits[bsz:, :-1].clone()
        return split(self, out, bsz)

    monkeypatch.setattr(Ride, "split", off_by_one)
    counts, exact, _ = _sampled_pairs(False, monkeypatch, chunk=5)
    assert chi2_pvalue(counts, exact) < P_FLOOR


def test_a_verifier_that_skips_the_residual_fails_the_same_test(monkeypatch):
    counts, exact, _ = _sampled_pairs(True, monkeypatch)
    assert chi2_pvalue(counts, exact) < 1e-6


# -- the job ------------------------------------------------------------------------------------


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_continuous_job_writes_in_input_order_like_static(tiny_family, tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"def f{i}(x):\n" + "    x += 1\n" * (i % 4), "max_new_tokens": [2, 24, 5, 16, 3][i % 5]}
            for i in range(10)]
    rows[3] = "{broken"
    rows.insert(7, {"id": "empty", "prompt": ""})
    src = _jsonl(tmp_path / "in.jsonl", rows)
    outs = {}
    for schedule, extra in (("static", []), ("continuous", []), ("chunked", ["--prefill-chunk", "4"])):
        out = tmp_path / f"{schedule}.jsonl"
        res = invoke(["decode", "--target", tiny_family / "target", "--in", src, "--out", out, "--batch-size", "3",
                      "--drafter", tiny_family / "draft", "--schedule", "static" if schedule == "static" else "continuous", *extra])
        assert res.exit_code == 3, res.output  # two bad records
        outs[schedule] = _read(out)
        assert [o["line"] for o in outs[schedule]] == list(range(1, len(rows) + 1))
    for schedule in ("continuous", "chunked"):
        assert [o.get("completion") for o in outs[schedule]] == [o.get("completion") for o in outs["static"]]
        assert [o.get("error") for o in outs[schedule]] == [o.get("error") for o in outs["static"]]
        assert all(o["stats"]["wall_s"] > 0 for o in outs[schedule] if "stats" in o)


def test_continuous_job_resumes_and_flushes_every_batch(tiny_family, tmp_path, monkeypatch):
    from specdec.decode.jobs.io import JsonlWriter
    from specdec.decode.jobs.job import Decoder
    from specdec.decode.options import DecodeOptions

    rows = [{"id": f"r{i}", "prompt": f"x = {i}\n" * (1 + i % 3), "max_new_tokens": 2 + 7 * (i % 3)} for i in range(11)]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    full = tmp_path / "full.jsonl"
    assert invoke(["decode", "--target", tiny_family / "target", "--in", src, "--out", full, "--batch-size", "2"]).exit_code == 0
    partial = tmp_path / "out.jsonl"
    partial.write_text("".join(full.read_text().splitlines(keepends=True)[:4]))
    flushes = []
    monkeypatch.setattr(JsonlWriter, "flush", lambda self, real=JsonlWriter.flush: (flushes.append(self._buffered), real(self)))
    decoder = Decoder(str(tiny_family / "target"), DecodeOptions(batch_size=2, max_new_tokens=8))
    assert decoder.schedule == "continuous"
    from specdec.decode.jobs.io import read_records

    writer = JsonlWriter(partial)
    try:
        summary = decoder.run(read_records(str(src)), writer)
        writer.finish()
    finally:
        writer.close()
    assert summary.skipped == 4 and summary.ok == 7
    # made durable batch by batch while decoding, not only at the end (a record waiting for an earlier,
    # longer one is written with it, so one flush may hold more than a batch)
    assert sum(flushes) == 7 and len([n for n in flushes if n]) >= 2
    assert [o["completion"] for o in _read(partial)] == [o["completion"] for o in _read(full)]


def test_schedule_is_static_for_diffusion_lms_and_an_explicit_continuous_is_refused(tmp_path):
    from specdec.decode.jobs.validate import resolve_schedule

    assert resolve_schedule("auto", False, "t") == "continuous" and resolve_schedule("static", False, "t") == "static"
    assert resolve_schedule("auto", True, "t") == "static" and resolve_schedule("static", True, "t") == "static"
    with pytest.raises(UsageError, match="diffusion LM.*--schedule continuous applies to causal LMs"):
        resolve_schedule("continuous", True, "t")
    with pytest.raises(UsageError, match="--schedule must be one of auto, continuous, static"):
        resolve_schedule("sometimes", False, "t")
    dllm = tmp_path / "dllm"
    dllm.mkdir()
    (dllm / "config.json").write_text(json.dumps({"kind": "dllm"}))  # refused before anything loads
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    res = invoke(["decode", "--target", dllm, "--in", src, "--out", tmp_path / "o.jsonl", "--schedule", "continuous"])
    assert res.exit_code == 2 and "diffusion LM" in res.output, res.output
