"""Retrieval drafts (``retrieval:INDEX``, REST) and their fusion with a draft model
(``draft+retrieval=INDEX``, RASD): the suffix array and lookups against brute force, the trie and
the fused tree, greedy output identical to plain decoding (batch 1 and 3, continuous batching),
the target's joint distribution at T>0, and ``specdec index build``."""

import json
import random

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, staggered_requests, tiny_llama, tiny_tokenizer
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.drafters.base import Segment
from specdec.decode.engine.loop import Batch, SpecEngine
from specdec.decode.options import DecodeOptions
from specdec.decode.drafters.registry import build_drafter, check_drafter_options
from specdec.decode.drafters.retrieval import (
    SEPARATOR,
    Datastore,
    RasdDrafter,
    RetrievalDrafter,
    Trie,
    build_arrays,
    open_datastore,
    save_datastore,
)
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.artifacts import tokenizer_fingerprint
from specdec.models.errors import SpecdecError, UsageError


class _Batch:
    def __init__(self, seqs, k=8):
        self.seqs, self.num_draft, self.device = seqs, k, torch.device("cpu")
        self.sampling = Sampling()


def _random_docs(seed: int, n: int = 25, vocab: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suffix_array_and_lookup_match_brute_force(seed):
    docs = _random_docs(seed)
    docs.append(docs[0] * 3)  # a long repeat: the prefix doubling needs several rounds
    tokens, sa = build_arrays(docs)
    flat = tokens.tolist()
    assert flat.count(SEPARATOR) == len(docs)
    # Python compares lists as the suffix array orders suffixes: the separator below every token, a
    # suffix that ends first below its extensions
    assert sa.tolist() == sorted(range(len(flat)), key=lambda i: flat[i:])
    store = Datastore(tokens, sa)
    rng = random.Random(seed)
    for _ in range(60):
        pattern = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
        lo, hi = store.find(pattern)
        hits = sorted(i for i in range(len(flat)) if flat[i : i + len(pattern)] == pattern)
        assert sorted(store.sa[lo:hi]) == hits
    for _ in range(30):
        seq = [rng.randrange(5) for _ in range(rng.randrange(2, 12))]
        # brute force: the longest suffix (2..8 tokens) with an occurrence that has tokens after it
        expected = []
        for n in range(min(8, len(seq)), 1, -1):
            conts = []
            for i in range(len(flat) - n + 1):
                if flat[i : i + n] == seq[-n:]:
                    cont = flat[i + n : i + n + 4]
                    cont = cont[: cont.index(SEPARATOR)] if SEPARATOR in cont else cont
                    if cont:
                        conts.append(cont)
            if conts:
                expected = conts
                break
        got = store.continuations(seq, max_suffix=8, min_suffix=2, depth=4, cap=10_000)
        assert sorted(got) == sorted(expected)


def test_lookup_takes_the_longest_suffix_stops_at_documents_and_caps_occurrences():
    store = Datastore.from_documents([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7], [8, 3, 4, 1]])
    # [2, 3, 4] is the longest suffix of [8, 2, 3, 4] in the corpus ([3, 4] alone occurs once more)
    assert sorted(store.continuations([8, 2, 3, 4], 16, 2, 5, 64)) == [[5], [5, 7], [6]]
    # the continuation of a document's last tokens is empty; [4, 5] ends doc 0, so only doc 2's counts
    assert store.continuations([4, 5], 16, 2, 5, 64) == [[7]]
    # the longest suffix wins: [3, 4, 5] ends doc 0 and goes on in doc 2 (as [4, 5] would)
    assert store.continuations([0, 3, 4, 5], 16, 2, 5, 64) == [[7]]
    # not even min_suffix tokens occur: nothing
    assert store.continuations([5, 9], 16, 2, 5, 64) == []
    assert len(store.continuations([3, 4], 16, 2, 5, 2)) == 2  # at most ``cap`` occurrences


def test_trie_counts_and_best_first_order():
    store = Datastore.from_documents([[2, 3, 5], [2, 3, 5, 7], [2, 3, 6], [2, 3, 5, 7, 1]])
    trie = Trie(store.tokens, store.match([2, 3], 16, 2, 64), max_depth=2)
    assert trie.occurrences == 4 and trie.token == [5, 6] and trie.count == [3, 1]  # only the first level is counted
    order = []
    while (node := trie.take()) is not None:
        order.append(node)
        trie.expand(node)
    # 5 (3 occurrences), then 7 after it (2) before 6 (1); max_depth keeps 7's child 1 out
    assert [trie.token[i] for i in order] == [5, 7, 6] and [trie.parent[i] for i in order] == [-1, 0, -1]
    assert [trie.count[i] for i in order] == [3, 2, 1] and len(trie.token) == 3
    drafter = RetrievalDrafter(Datastore.from_documents([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7]]))
    # 5 follows twice (then 7 once), 6 once: count first, the shallower node on ties
    assert drafter.tree([8, 2, 3, 4], budget=3) == ([5, 6, 7], [-1, -1, 0])
    assert drafter.tree([8, 2, 3, 4], budget=1) == ([5], [-1])
    p = drafter.propose(_Batch([[8, 2, 3, 4], [0, 0], [2, 3, 4]], k=3))
    assert p.tokens.tolist() == [[5, 6, 7], [0, 0, 0], [5, 6, 7]]
    assert p.parents.tolist() == [[-1, -1, 0], [-2, -2, -2], [-1, -1, 0]]  # a row without a match drafts nothing
    assert p.max_depth == 2
    assert drafter.propose(_Batch([[0, 0]])) is None


def test_fusion_merges_by_prefix_and_prunes_with_the_draft():
    store = Datastore.from_documents([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7], [2, 3, 4, 8, 1], [3, 4, 8, 1]])
    d = RasdDrafter(tiny_llama(seed=1, layers=1, hidden=32), store, retrieval_tokens=8, prune_top_k=2)
    def trie():  # after [2, 3, 4]: 5 (then 7), 6, 8 1 (counts 2, 1, 1); a fused tree consumes its trie
        return d.retrieval.trie([0, 2, 3, 4], 8)

    chain = [5, 9, 9]
    # the draft's two likeliest tokens after the root, after chain node 0 and after chain node 1
    top = [{5, 8}, {7, 1}, {9, 4}]
    tokens, parents = d._fuse(chain, top, trie())
    # 5 is chain node 0 (merged); 6 is pruned (not among the draft's top tokens after the root), 8 is
    # among them; 7 hangs from chain node 0 and is among the draft's top there; 8's child 1 is off the
    # chain, where the draft has no distribution: kept. Best count first, so 8 before 7.
    assert tokens == [5, 9, 9, 8, 7, 1]
    assert parents == [-1, 0, 1, -1, 0, 3]
    # a draft that ranks none of them keeps what the corpus is confident of: 7 takes half of the
    # occurrences through 5 (keep_share 0.5); 6 and 8 take a quarter each of the root's four
    nothing = [set(), set(), set()]
    assert d._fuse(chain, nothing, trie()) == ([5, 9, 9, 7], [-1, 0, 1, 0])
    d.keep_share = 1.0
    assert d._fuse(chain, nothing, trie()) == (chain, [-1, 0, 1])
    d.retrieval_tokens = 1
    assert d._fuse(chain, top, trie()) == ([5, 9, 9, 8], [-1, 0, 1, -1])  # the budget counts new nodes only


@pytest.mark.parametrize("along_chain", [True, False])
def test_the_draft_keeps_its_cache_only_along_its_own_chain(draft_model, along_chain):
    """After a round, the draft's cache keeps the accepted drafts that are its own chain's; an accepted
    retrieval branch leaves nothing of the chain, so the next round feeds those tokens anew."""
    store = Datastore.from_documents([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9], [2, 3, 10, 11]])
    d = RasdDrafter(draft_model, store, prune_top_k=96)  # the draft prunes nothing
    def batch(seqs, k=3):  # the engine's own: the draft model's cache reads what it says
        return Batch(seqs, torch.tensor([s[-1] for s in seqs]), Sampling(), None, torch.device("cpu"), k)

    seq = [20, 21, 2, 3]
    d.begin(batch([seq]), None)
    p = d.propose(batch([seq]))
    tokens, parents = p.tokens[0].tolist(), p.parents[0].tolist()
    assert parents[:3] == [-1, 0, 1] and len(tokens) > 3  # the chain, then retrieval nodes
    # a depth-1 node: chain node 0, or a retrieval node hanging from the root
    node = 0 if along_chain else next(i for i in range(3, len(tokens)) if parents[i] == -1 and tokens[i] != tokens[0])
    seq = seq + [tokens[node], 99]  # the target kept that node and emitted 99
    d.observe(batch([seq]), Segment(None, None, None, None, keep_index=torch.tensor([[0, node + 1]]),
                                      keep_valid=torch.tensor([[True, True]]), accepted=[1]))
    assert d.fed == [len(seq) - 1 if along_chain else len(seq) - 2]


# ---------------------------------------------------------------------------------------------
# decoding


@pytest.fixture(scope="module")
def plain(target):
    return SpecEngine(target, ByteTokenizer()).generate(staggered_requests())


@pytest.fixture(scope="module")
def store(target):
    """Random documents plus the target's own greedy text after half of the test prompts (cut short, so
    some lookups hit, some miss and some go off the end of what the corpus knows)."""
    reqs = staggered_requests()
    own = SpecEngine(target, ByteTokenizer()).generate([GenRequest(r.prompt_ids, 20) for r in reqs[::2]])
    docs = [r.prompt_ids + o.token_ids for r, o in zip(reqs[::2], own)] + make_prompts(20, seed=5)
    return Datastore.from_documents(docs)


def _decode(target, drafter, reqs, bsz):
    engine = SpecEngine(target, ByteTokenizer(), drafter)
    got = []
    for i in range(0, len(reqs), bsz):
        got += engine.generate(reqs[i : i + bsz])
    return got


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
def test_greedy_is_lossless(target, draft_model, plain, store, bsz, fused):
    drafter = RasdDrafter(draft_model, store) if fused else RetrievalDrafter(store)
    got = _decode(target, drafter, staggered_requests(), bsz)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in plain]
    assert sum(r.stats["accepted_tokens"] for r in got) > 0  # drafts were proposed and some kept


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_is_lossless_when_streamed(target, draft_model, plain, store, fused):
    drafter = RasdDrafter(draft_model, store) if fused else RetrievalDrafter(store)
    got = dict(SpecEngine(target, ByteTokenizer(), drafter).stream(staggered_requests(), batch_size=2))
    assert [got[i].token_ids for i in range(len(plain))] == [r.token_ids for r in plain]


def test_a_corpus_with_the_targets_text_is_retrieved(target, draft_model):
    """Greedy continuations in the corpus are drafted whole: far fewer target forwards than tokens."""
    prompts = make_prompts(4, seed=3, lo=8, hi=20)
    reqs = [GenRequest(p, 40) for p in prompts]
    ref = SpecEngine(target, ByteTokenizer(), eos_ids=[]).generate(reqs)
    store = Datastore.from_documents([p + r.token_ids for p, r in zip(prompts, ref)] + make_prompts(30, seed=9))
    for drafter in (RetrievalDrafter(store), RasdDrafter(draft_model, store)):
        res = SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[]).generate(reqs)
        assert [r.token_ids for r in res] == [r.token_ids for r in ref]
        tau = sum(len(r.token_ids) for r in res) / sum(r.stats["target_calls"] for r in res)
        assert tau > 1.5, (type(drafter).__name__, tau)
    # and the fused tree does better than the draft model's chain alone, which knows nothing of the corpus
    from specdec.decode.drafters.draft_model import ModelDrafter

    alone = SpecEngine(target, ByteTokenizer(), ModelDrafter(draft_model), eos_ids=[]).generate(reqs)
    fused = SpecEngine(target, ByteTokenizer(), RasdDrafter(draft_model, store), eos_ids=[]).generate(reqs)
    assert sum(r.stats["target_calls"] for r in fused) < sum(r.stats["target_calls"] for r in alone)


@pytest.mark.parametrize("fused", [False, True])
def test_engine_samples_the_target_joint_distribution(fused):
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    prompt = [5, 7, 5, 7, 5]
    # after [5, t] the corpus goes on in three ways: the tree's first level has siblings
    store = Datastore.from_documents([[7, 5, t, u, 1] for t in range(vocab) for u in (0, 4, 8)] + [[5, 7, 5, 7, 5, 3, 4]] * 3)
    drafter = RasdDrafter(tiny_llama(vocab=vocab, hidden=32, layers=1, seed=4), store) if fused else RetrievalDrafter(store)
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3 if fused else 8, seed=123, eos_ids=[])
    rows = 6000
    res = engine.generate([GenRequest(prompt, 2) for _ in range(rows)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0  # drafts were actually tested


# ---------------------------------------------------------------------------------------------
# the registry and the CLI


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    tok = tiny_tokenizer()
    out = tmp_path_factory.mktemp("index") / "idx"
    docs = [tok("def add(a, b):\n    return a + b\n")["input_ids"], tok("for i in range(10):\n")["input_ids"]]
    save_datastore(out, docs, tokenizer_fingerprint(tok), ["test"])
    return out


def test_registry_builds_both_methods_and_refuses_what_does_not_apply(tiny_family, index):
    from specdec.decode.jobs.build import load_decode_target

    opts = DecodeOptions()
    target, tok, _ = load_decode_target(str(tiny_family / "target"), opts)
    assert isinstance(build_drafter(f"retrieval:{index}", target, tok, opts), RetrievalDrafter)
    fused = build_drafter(str(tiny_family / "draft"), target, tok, opts.with_overrides({"retrieval": str(index)}))
    assert isinstance(fused, RasdDrafter) and len(fused.retrieval.store) > 0
    with pytest.raises(UsageError, match="retrieval:INDEX"):
        build_drafter("retrieval", target, tok, opts)
    with pytest.raises(UsageError, match="not a retrieval index"):
        build_drafter(f"retrieval:{tiny_family / 'draft'}", target, tok, opts)
    with pytest.raises(UsageError, match="--retrieval applies to draft models"):
        check_drafter_options("ngram", opts.with_overrides({"retrieval": str(index)}))
    with pytest.raises(UsageError, match="--acceptance"):
        build_drafter(str(tiny_family / "draft"), target, tok, opts.with_overrides({"retrieval": str(index), "acceptance": "x"}))
    other = tiny_tokenizer()
    other.add_tokens(["<extra_token>"])
    with pytest.raises(SpecdecError, match="another tokenizer"):
        build_drafter(f"retrieval:{index}", target, other, opts)


def test_index_build_round_trip_and_errors(tiny_family, tmp_path):
    tok = tiny_tokenizer()
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n"}) + "\n"
                     + json.dumps({"prompt": "for i in range(10):\n", "completion": "    print(i * i)\n"}) + "\n")
    txt = tmp_path / "b.py"
    txt.write_text("import os\nimport sys\n")
    out = tmp_path / "idx"
    args = ["index", "build", "--data", jsonl, "--data", txt, "--target", tiny_family / "target", "--out", out]
    res = invoke(args)
    assert res.exit_code == 0, res.output
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n", "import os\nimport sys\n"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    n_tokens = sum(map(len, ids))
    assert f"indexed {n_tokens} tokens in 3 documents" in res.stdout
    store = open_datastore(out, tok)
    assert list(store.tokens) == [t for doc in ids for t in doc + [SEPARATOR]]
    assert store.config["specdec_target"] == tokenizer_fingerprint(tok)
    # the index drafts: what follows "for i in range(10):\n" in the corpus
    assert store.continuations(ids[1][:-2], 16, 2, 2, 64) == [ids[1][-2:]]

    def error(result, code, needle):
        assert result.exit_code == code, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
        assert "Traceback" not in result.output

    error(invoke(args), 2, "--overwrite")
    assert invoke([*args, "--overwrite"]).exit_code == 0
    error(invoke(["index", "build", "--data", tmp_path / "nope.jsonl", "--target", tiny_family / "target", "--out", tmp_path / "x"]),
          2, "no such file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": 1, "error": "failed"}) + "\n")
    error(invoke(["index", "build", "--data", empty, "--target", tiny_family / "target", "--out", tmp_path / "y"]), 1, "no text")
    assert not (tmp_path / "y").exists()
    other = tmp_path / "not-an-index"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    error(invoke(["index", "build", "--data", txt, "--target", tiny_family / "target", "--out", other, "--overwrite"]),
          2, "not a retrieval index")
    assert (other / "keep.txt").read_text() == "mine"


def test_decode_with_an_index_from_the_cli(tiny_family, index, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n" + json.dumps({"prompt": "for i in"}) + "\n")
    outs = {}
    for name, extra in (("ar", []), ("retrieval", ["--drafter", f"retrieval:{index}"]),
                        ("rasd", ["--drafter", tiny_family / "draft", "--retrieval", index])):
        out = tmp_path / f"{name}.jsonl"
        res = invoke(["decode", "--in", src, "--out", out, "--target", tiny_family / "target", "--max-new-tokens", "12", *extra])
        assert res.exit_code == 0, res.output
        outs[name] = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert outs["retrieval"] == outs["ar"] and outs["rasd"] == outs["ar"]
    res = invoke(["decode", "--in", src, "--out", tmp_path / "x.jsonl", "--target", tiny_family / "target",
                  "--drafter", "ngram", "--retrieval", index])
    assert res.exit_code == 2 and "--retrieval applies to draft models" in res.stderr
