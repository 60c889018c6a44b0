"""PEARL (decode/drafters/pearl.py): the draft drafts the next block in a thread of its own while the target
verifies, optionally the target tests the first draft while the draft draws the rest (pre-verify),
and decoding stays lossless.

Greedy output equals plain greedy (batch sizes 1 and 3, rows finishing at different times, rows
joining a running batch) with blocks kept and rolled back; at T>0 the first three tokens follow the
target's distribution (chi-square), and a variant whose kept blocks lose the q their drafts were
drawn from fails the same test. The draft's cache is never touched by two threads at once, a failure
in the background thread is an error (not a hang), and the block length follows the time the target
leaves the draft. Pre-verify: greedy output equals plain greedy (rounds cut at a rejected first draft,
rows of one batch split between the two outcomes, rows joining), every block is a fresh draft's, and
at T>0 the token a pre-verified round emits first follows the target (chi-square), which variants that
skip the first draft's test or draw its correction token from p instead of the residual fail.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from specdec.decode.engine import split as split_module
from specdec.decode.drafters import pearl
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.base import NoDrafter, Proposal
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.options import DecodeOptions, parse_method
from specdec.decode.drafters.pearl import ParallelDrafter
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling, Verdict, logits_to_probs
from test_sampling import P_FLOOR, chi2_pvalue


@pytest.fixture(autouse=True)
def one_thread_per_model():
    """Two models at once on a CPU: one intra-op thread each (torch's setting is process-wide)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def requests(prompts, budgets):
    return [GenRequest(p, n) for p, n in zip(prompts, budgets)]


@pytest.fixture(scope="module")
def twin(target):
    """A draft that agrees with the target (its copy): every block is accepted, so blocks are kept."""
    return copy.deepcopy(target)


@pytest.fixture(scope="module")
def near(target):
    """A draft that mostly agrees with the target: blocks kept, blocks rejected, guesses missed."""
    model = copy.deepcopy(target)
    noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0), dtype=model.lm_head.weight.dtype)
    with torch.no_grad():
        model.lm_head.weight.add_(noise * 0.05)
    return model


@pytest.fixture(scope="module")
def drafts(twin, near, draft_model):
    return {"twin": twin, "near": near, "poor": draft_model}


def run(target, drafter, reqs, num_draft=4, batch_size=None):
    engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(), num_draft=num_draft, seed=0)
    if batch_size is None:
        return {i: r for i, r in enumerate(engine.generate(list(reqs)))}
    return dict(engine.stream(iter(reqs), batch_size=batch_size))


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("which", ["twin", "near", "poor"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_is_plain_greedy(target, drafts, bsz, which, adaptive):
    reqs = requests(make_prompts(bsz, seed=31 + bsz), [40, 23, 31][:bsz])
    drafter = ParallelDrafter(drafts[which], adaptive=adaptive)
    spec, ar = run(target, drafter, reqs), run(target, NoDrafter(), reqs)
    assert [r.token_ids for r in spec.values()] == [r.token_ids for r in ar.values()]
    assert [r.finish_reason for r in spec.values()] == [r.finish_reason for r in ar.values()]
    if which == "twin" and not adaptive:  # the thread always drafts a whole block: some are kept
        assert drafter.ready_rounds > 0
    if which == "poor":
        assert drafter.ready_rounds == 0


@pytest.mark.parametrize("which", ["twin", "near", "poor"])
def test_greedy_with_rows_joining_a_running_batch(target, drafts, which):
    reqs = [GenRequest(p, 4 + 9 * (i % 3)) for i, p in enumerate(make_prompts(7, seed=3))]
    drafter = ParallelDrafter(drafts[which], adaptive=False)
    spec, ar = run(target, drafter, reqs, batch_size=3), run(target, NoDrafter(), reqs, batch_size=3)
    assert {i: r.token_ids for i, r in spec.items()} == {i: r.token_ids for i, r in ar.items()}


def test_every_proposal_is_what_a_fresh_draft_of_the_text_proposes(target, near):
    """A kept block, and every block drafted after a keep or a rollback, is what a drafter that
    prefills the committed text drafts: the cache the thread leaves (the block's drafts, the guess,
    the drafts after it) is kept or cut exactly where the text says."""
    drafter = ParallelDrafter(near, adaptive=False)
    kinds = []
    propose = drafter.propose

    def spy(batch):
        ready = drafter._ready is not None
        proposal = propose(batch)
        fresh = ModelDrafter(near)
        fresh.begin(batch, None)
        assert torch.equal(proposal.tokens, fresh.propose(batch).tokens)
        kinds.append(ready)
        return proposal

    drafter.propose = spy
    reqs = requests(make_prompts(3, seed=5), [48, 48, 48])
    run(target, drafter, reqs, num_draft=3, batch_size=1)
    assert drafter.ready_rounds == sum(kinds) > 2
    # rounds drafted in the loop's thread right after a kept block: the cache cut back after a miss
    assert any(a and not b for a, b in zip(kinds, kinds[1:]))


def test_the_draft_drafts_ahead_only_after_a_fully_accepted_block(target, near, monkeypatch):
    """PEARL's switch: after a rejection the round is plain (no thread); after a fully accepted block
    the draft drafts ahead. Not adaptive: every round drafts ahead."""
    for adaptive in (True, False):
        drafter = ParallelDrafter(near, adaptive=adaptive)
        started, full = [], []
        start, observe = drafter._start, drafter.observe

        def spy_start(*args, start=start, started=started):
            started[-1] = True
            return start(*args)

        def spy_observe(batch, seg, observe=observe, full=full, drafter=drafter):
            full.append(all(a == drafter._proposed for a in seg.accepted))
            return observe(batch, seg)

        drafter._start, drafter.observe = spy_start, spy_observe
        propose = drafter.propose

        def spy_propose(batch, propose=propose, started=started):
            started.append(False)
            return propose(batch)

        drafter.propose = spy_propose
        run(target, drafter, requests(make_prompts(1, seed=5), [64]), num_draft=3)
        assert any(full) and not all(full)
        if adaptive:
            assert started == [False] + full[:-1]
        else:
            assert all(started)


def bigram(vocab: int, scale: float):
    """A model whose next token depends on the last token only (attention and MLP outputs zeroed, the
    cache still kept): a long sample is a Markov chain whose transitions are known exactly."""
    model = tiny_llama(vocab=vocab, hidden=32, layers=1, seed=3, max_pos=8192)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(scale)
    return model


def _kept_blocks_with_shifted_q(monkeypatch):
    """Broken on purpose: a kept block reports, for each draft, the q of the step before it (the
    guess's q for the first draft): the drafts were drawn from one distribution, verified against another."""

    def shifted(tokens, probs):
        if len(tokens) < 2:
            return None
        return Proposal(tokens=torch.stack(tokens[1:], 1), draft_probs=torch.stack(probs[:-1], 1))

    monkeypatch.setattr(pearl, "block_after_guess", shifted)


@pytest.mark.parametrize("variant", ["pearl", "broken"])
def test_sampling_follows_the_target_distribution(variant, monkeypatch):
    """One long row of a bigram target: every token pair follows its transition matrix, and so does
    the first token after each kept block (where the broken variant differs). A sharp draft of a flat
    target makes a misreported q show: its drafts are accepted far more often than they should be."""
    vocab, tokens = 6, 3000
    target = bigram(vocab, 0.1)
    draft = bigram(vocab, 10.0)
    if variant == "broken":
        _kept_blocks_with_shifted_q(monkeypatch)
    drafter = ParallelDrafter(draft, adaptive=False)  # whole blocks every round: a seed reproduces the run
    starts, propose = [], drafter.propose

    def spy(batch):
        if drafter._ready is not None:
            starts.append(len(batch.seqs[0]))  # the next token is the first one verified from a kept block
        return propose(batch)

    drafter.propose = spy
    sampling = Sampling(temperature=0.9)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=1, seed=7, eos_ids=[])
    seq = [3] + engine.generate([GenRequest([3], tokens)])[0].token_ids
    with torch.no_grad():
        transitions = logits_to_probs(target(torch.arange(vocab)[:, None]).logits[:, -1], sampling).double()

    def pvalue(pairs):
        counts = torch.bincount(torch.tensor([a * vocab + b for a, b in pairs]), minlength=vocab * vocab).double()
        first = counts.reshape(vocab, vocab).sum(1, keepdim=True)  # expected: each first token's count times its row
        return chi2_pvalue(counts, (first / first.sum() * transitions).reshape(-1))

    after_kept = pvalue([(seq[s - 1], seq[s]) for s in starts])
    print(f"\n{variant}: chi-square p = {after_kept:.3g} after {len(starts)} kept blocks")
    assert len(starts) > 100
    if variant == "broken":
        assert after_kept < 1e-6
    else:
        assert after_kept > P_FLOOR
        assert pvalue(list(zip(seq[:-1], seq[1:]))) > P_FLOOR


def test_the_draft_cache_is_never_touched_by_two_threads(target, twin, monkeypatch):
    """Every cache operation holds a lock it must get at once; each forward sleeps a little so an
    overlap, were there one, would be caught."""
    from specdec.decode.engine.cache import KVState

    lock, overlaps, threads = threading.Lock(), [], set()
    drafter = ParallelDrafter(twin)

    def guarded(name):
        real = getattr(KVState, name)

        def op(self, *args, **kwargs):
            if self is not drafter.state:
                return real(self, *args, **kwargs)
            if not lock.acquire(blocking=False):
                overlaps.append(name)
                return real(self, *args, **kwargs)
            try:
                threads.add(threading.get_ident())
                if name == "forward":
                    time.sleep(0.002)
                return real(self, *args, **kwargs)
            finally:
                lock.release()

        return op

    for name in ("forward", "commit_prefix", "rollback", "select_rows", "admit"):
        monkeypatch.setattr(KVState, name, guarded(name))
    reqs = [GenRequest(p, 6 + 7 * (i % 3)) for i, p in enumerate(make_prompts(6, seed=8))]
    spec, ar = run(target, drafter, reqs, batch_size=2), run(target, NoDrafter(), reqs, batch_size=2)
    assert {i: r.token_ids for i, r in spec.items()} == {i: r.token_ids for i, r in ar.items()}
    assert not overlaps
    assert len(threads) > 1  # the background thread did draft


def test_the_two_threads_share_the_cores_while_both_run(target, twin, monkeypatch):
    """On a CPU each thread has half the intra-op threads while the draft runs beside the target's
    verification, and the loop's thread gets its own back at the join."""
    torch.set_num_threads(4)
    drafter = ParallelDrafter(twin, adaptive=False)
    seen = {"draft": set(), "verify": set()}
    draft_ahead, verify = drafter._draft_ahead, SpecEngine._verify

    def counted_draft(*args):
        seen["draft"].add(torch.get_num_threads())
        return draft_ahead(*args)

    def counted_verify(self, *args, **kwargs):
        if drafter._thread is not None:
            seen["verify"].add(torch.get_num_threads())
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(drafter, "_draft_ahead", counted_draft)
    monkeypatch.setattr(SpecEngine, "_verify", counted_verify)
    reqs = requests(make_prompts(2, seed=5), [30, 21])
    spec, ar = run(target, drafter, reqs), run(target, NoDrafter(), reqs)
    assert [r.token_ids for r in spec.values()] == [r.token_ids for r in ar.values()]
    assert seen == {"draft": {2}, "verify": {2}}
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("pre_verify", [False, True])
def test_a_failure_in_the_background_thread_is_an_error_not_a_hang(target, twin, monkeypatch, pre_verify):
    """The thread drafts every round, verdict or not (post-verify), or draws the block the engine waits
    on (pre-verify): a failure there raises instead of hanging."""
    drafter = ParallelDrafter(twin, pre_verify=True) if pre_verify else ParallelDrafter(twin, adaptive=False)
    loop = []  # the thread the decode loop runs in
    sample = ParallelDrafter._sample

    def failing(self, logits, sampling):
        if threading.get_ident() != loop[0]:
            raise ValueError("draft step failed")
        return sample(self, logits, sampling)

    monkeypatch.setattr(ParallelDrafter, "_sample", failing)
    outcome = []

    def decode():
        loop.append(threading.get_ident())
        try:
            run(target, drafter, requests(make_prompts(2, seed=4), [20, 20]))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    worker = threading.Thread(target=decode, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "decoding hung on a failed background draft"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert isinstance(outcome[0].__cause__, ValueError)


def _slow(model, seconds):
    model = copy.deepcopy(model)
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model


@pytest.mark.parametrize("adaptive", [True, False])
def test_block_length_follows_the_time_the_target_leaves_the_draft(target, adaptive):
    """A slow target leaves the draft time for whole blocks; a slow draft is stopped by the verdict
    (adaptive), so its kept blocks are short, unless it must always draft whole blocks."""
    k = 5
    lengths = {}
    for name, tgt, draft in (("slow target", _slow(target, 0.05), copy.deepcopy(target)),
                             ("slow draft", target, _slow(target, 0.02))):
        drafter = ParallelDrafter(draft, adaptive=adaptive)
        sizes = []
        propose = drafter.propose

        def spy(batch, propose=propose, drafter=drafter, sizes=sizes):
            ready = drafter._ready is not None
            proposal = propose(batch)
            if ready:
                sizes.append(proposal.tokens.shape[1])
            return proposal

        drafter.propose = spy
        run(tgt, drafter, requests(make_prompts(1, seed=6), [30]), num_draft=k)
        lengths[name] = sizes
    assert lengths["slow target"] and all(n == k for n in lengths["slow target"])
    if adaptive:
        assert all(n < k for n in lengths["slow draft"])
    else:
        assert lengths["slow draft"] and all(n == k for n in lengths["slow draft"])


def test_method_spec_and_flag_build_the_parallel_drafter(tiny_family, tmp_path):
    import json

    from specdec.decode.drafters.registry import build_drafter, check_drafter_options
    from specdec.decode.jobs.build import load_decode_target
    from specdec.models.errors import UsageError

    head, overrides = parse_method("draft+parallel=1+k=3")
    opts = DecodeOptions(device="cpu").with_overrides(overrides)
    assert (head, opts.drafting.parallel, opts.drafting.num_draft) == ("draft", True, 3)
    target, tok, _ = load_decode_target(str(tiny_family / "target"), opts)
    drafter = build_drafter(str(tiny_family / "draft"), target, tok, opts)
    assert isinstance(drafter, ParallelDrafter)
    prompts = [tok.encode("def add(a, b):\n"), tok.encode("for i in range(10):\n")]
    ar = SpecEngine(target, tok).generate(requests(prompts, [24, 24]))
    spec = SpecEngine(target, tok, drafter, num_draft=3).generate(requests(prompts, [24, 24]))
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    for spec_text, needle in (("ngram", "draft models"), ("draft+verify=rsd", "does not combine"), ("draft+online=1", "does not combine")):
        name, more = parse_method(spec_text)
        with pytest.raises(UsageError, match=needle):
            check_drafter_options(name if name != "draft" else str(tiny_family / "draft"), opts.with_overrides(more))

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    outs = {}
    for flags in ([], ["--drafter", tiny_family / "draft", "--parallel"]):
        out = tmp_path / f"out{len(flags)}.jsonl"
        res = invoke(["decode", "--in", src, "--out", out, "--target", tiny_family / "target", "--max-new-tokens", "16", *flags])
        assert res.exit_code == 0, res.output
        outs[len(flags)] = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert outs[0] == outs[3]
    res = invoke(["decode", "--in", src, "--out", tmp_path / "bad.jsonl", "--target", tiny_family / "target", "--drafter", "ngram", "--parallel"])
    assert res.exit_code == 2 and "--parallel" in res.stderr


# -- pre-verify -------------------------------------------------------------------------------------


def count_split_rounds(monkeypatch):
    """Per pre-verified round of the engine, how many rows accepted the first draft, and of how many."""
    rounds = []
    split = split_module.verify

    def spy(engine, state, batch, first):
        seg, verdict, proposal = split(engine, state, batch, first)
        rounds.append((int((verdict.accepted > 0).sum()), len(batch.seqs)))
        return seg, verdict, proposal

    monkeypatch.setattr(split_module, "verify", spy)
    return rounds


@pytest.mark.parametrize("which", ["twin", "near", "poor"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_pre_verify_greedy_is_plain_greedy(target, drafts, bsz, which, monkeypatch):
    rounds = count_split_rounds(monkeypatch)
    reqs = requests(make_prompts(bsz, seed=31 + bsz), [40, 23, 31][:bsz])
    drafter = ParallelDrafter(drafts[which], pre_verify=True)
    spec, ar = run(target, drafter, reqs), run(target, NoDrafter(), reqs)
    assert [r.token_ids for r in spec.values()] == [r.token_ids for r in ar.values()]
    assert [r.finish_reason for r in spec.values()] == [r.finish_reason for r in ar.values()]
    assert rounds  # rounds that were pre-verified
    cut = sum(ok == 0 for ok, _ in rounds)
    assert drafter.cut_rounds == cut
    if which == "twin":
        assert cut == 0
    if which == "poor":  # the first draft is often rejected by every row: the round ends there
        assert cut > len(rounds) // 4
    if bsz == 3 and which != "twin":  # rows of one round on both sides of the first draft's test
        assert any(0 < ok < n for ok, n in rounds)


@pytest.mark.parametrize("which", ["twin", "near", "poor"])
def test_pre_verify_greedy_with_rows_joining_a_running_batch(target, drafts, which):
    reqs = [GenRequest(p, 4 + 9 * (i % 3)) for i, p in enumerate(make_prompts(7, seed=3))]
    for adaptive in (True, False):
        drafter = ParallelDrafter(drafts[which], adaptive=adaptive, pre_verify=True)
        spec, ar = run(target, drafter, reqs, batch_size=3), run(target, NoDrafter(), reqs, batch_size=3)
        assert {i: r.token_ids for i, r in spec.items()} == {i: r.token_ids for i, r in ar.items()}
        if which == "twin" and not adaptive:  # blocks drafted ahead after a pre-verified one are kept
            assert drafter.ready_rounds > 0


@pytest.mark.parametrize("adaptive", [True, False])
def test_pre_verified_blocks_are_what_a_fresh_draft_of_the_text_proposes(target, near, adaptive):
    """The first draft handed over, and the whole block ``rest`` returns, are what a drafter that
    prefills the committed text drafts: the thread's drafts after a cut round are rolled back exactly."""
    drafter = ParallelDrafter(near, adaptive=adaptive, pre_verify=True)
    whole, propose = [], drafter.propose

    def spy(batch):
        proposal = propose(batch)
        fresh = ModelDrafter(near)
        fresh.begin(batch, None)
        expected = fresh.propose(batch).tokens
        if proposal.rest is None:
            assert torch.equal(proposal.tokens, expected)
            return proposal
        assert torch.equal(proposal.tokens, expected[:, :1])
        rest = proposal.rest

        def checked():
            block = rest()
            assert torch.equal(block.tokens, expected)
            whole.append(block.tokens.shape[1])
            return block

        proposal.rest = checked
        return proposal

    drafter.propose = spy
    reqs = requests(make_prompts(3, seed=5), [48, 48, 48])
    run(target, drafter, reqs, num_draft=3, batch_size=1)
    assert whole and all(n == 3 for n in whole)
    assert drafter.cut_rounds > 0
    if not adaptive:  # kept blocks drafted ahead of pre-verified rounds
        assert drafter.ready_rounds > 0


def _without_first_draft_test(monkeypatch):
    """Broken on purpose: the first draft of a pre-verified round is taken as accepted, untested."""
    real = split_module.verify_chain

    def accept_first(logits, tokens, *args, **kwargs):
        verdict = real(logits, tokens, *args, **kwargs)
        if tokens.shape[1] != 1:
            return verdict
        ones = torch.ones_like(verdict.accepted)
        return Verdict(accepted=ones, path=torch.zeros_like(verdict.path), next_token=verdict.next_token)

    monkeypatch.setattr(split_module, "verify_chain", accept_first)


def _correction_from_p(monkeypatch):
    """Broken on purpose: the token after a rejected first draft is drawn from the target's p at the
    root, not from the residual max(p - q, 0)."""
    real = split_module.verify_chain

    def from_p(logits, tokens, draft_probs, sampling, generator, *args, **kwargs):
        verdict = real(logits, tokens, draft_probs, sampling, generator, *args, **kwargs)
        if tokens.shape[1] != 1:
            return verdict
        drawn = torch.multinomial(logits_to_probs(logits[:, 0], sampling), 1, generator=generator).squeeze(1)
        next_token = torch.where(verdict.accepted > 0, verdict.next_token, drawn)
        return Verdict(accepted=verdict.accepted, path=verdict.path, next_token=next_token)

    monkeypatch.setattr(split_module, "verify_chain", from_p)


@pytest.mark.parametrize("variant", ["pre-verify", "untested-first-draft", "correction-from-p"])
def test_pre_verify_sampling_follows_the_target_distribution(variant, monkeypatch):
    """As above, with pre-verify and three drafts a round: every token pair follows the target's
    transitions, and so does the first token of each pre-verified round (the first draft accepted, or
    the correction after its rejection), where the broken variants differ. (One-draft chains are
    verified only after the split, so the broken variants touch the first draft's test alone.)"""
    vocab, tokens = 6, 3000
    target = bigram(vocab, 0.1)
    draft = bigram(vocab, 10.0)
    if variant == "untested-first-draft":
        _without_first_draft_test(monkeypatch)
    elif variant == "correction-from-p":
        _correction_from_p(monkeypatch)
    drafter = ParallelDrafter(draft, adaptive=False, pre_verify=True)  # whole blocks: a seed reproduces the run
    starts, propose = [], drafter.propose

    def spy(batch):
        proposal = propose(batch)
        if proposal is not None and proposal.rest is not None:
            starts.append(len(batch.seqs[0]))  # the next token is the one the first draft's test decides
        return proposal

    drafter.propose = spy
    sampling = Sampling(temperature=0.9)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=7, eos_ids=[])
    seq = [3] + engine.generate([GenRequest([3], tokens)])[0].token_ids
    with torch.no_grad():
        transitions = logits_to_probs(target(torch.arange(vocab)[:, None]).logits[:, -1], sampling).double()

    def pvalue(pairs):
        counts = torch.bincount(torch.tensor([a * vocab + b for a, b in pairs]), minlength=vocab * vocab).double()
        first = counts.reshape(vocab, vocab).sum(1, keepdim=True)
        return chi2_pvalue(counts, (first / first.sum() * transitions).reshape(-1))

    at_first = pvalue([(seq[s - 1], seq[s]) for s in starts if s < len(seq)])
    print(f"\n{variant}: chi-square p = {at_first:.3g} over {len(starts)} pre-verified rounds, {drafter.cut_rounds} cut")
    assert len(starts) > 300
    if variant != "untested-first-draft":  # the first draft is rejected by the test often
        assert drafter.cut_rounds > 100
    if variant != "pre-verify":
        assert at_first < 1e-6
    else:
        assert at_first > P_FLOOR
        assert pvalue(list(zip(seq[:-1], seq[1:]))) > P_FLOOR


def test_pre_verify_method_option(tiny_family):
    from specdec.decode.drafters.registry import build_drafter, check_drafter_options
    from specdec.decode.jobs.build import load_decode_target
    from specdec.models.errors import UsageError

    head, overrides = parse_method("draft+parallel=1+pre-verify=1+k=3")
    opts = DecodeOptions(device="cpu").with_overrides(overrides)
    assert (head, opts.drafting.parallel, opts.drafting.pre_verify) == ("draft", True, True)
    target, tok, _ = load_decode_target(str(tiny_family / "target"), opts)
    drafter = build_drafter(str(tiny_family / "draft"), target, tok, opts)
    assert isinstance(drafter, ParallelDrafter) and drafter.pre_verify
    prompts = [tok.encode("def add(a, b):\n"), tok.encode("for i in range(10):\n")]
    ar = SpecEngine(target, tok).generate(requests(prompts, [24, 24]))
    spec = SpecEngine(target, tok, drafter, num_draft=3).generate(requests(prompts, [24, 24]))
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    _, more = parse_method("draft+pre-verify=1")
    with pytest.raises(UsageError, match="--parallel"):
        check_drafter_options(str(tiny_family / "draft"), DecodeOptions(device="cpu").with_overrides(more))
