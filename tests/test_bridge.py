"""A draft with a tokenizer of its own (universal assisted generation, ``decode.drafters.bridge``): its
drafts are re-tokenised into the target's tokens and verified as given tokens. Greedy output is plain
decoding's at batch sizes 1 and 3; T > 0 keeps the target's distribution; modes that need the draft's
distribution over the target's tokens are refused with one error line.

Two drafts: the target itself under a tokenizer whose ids are permuted (the same function of text under
other ids, so its drafts get accepted), and a small model with a BPE trained on other text."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import invoke, save_tiny_lm, tiny_tokenizer
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.drafters.bridge import TokenizerBridgeDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.artifacts import tokenizer_fingerprint


def permuted_twin(model, tokenizer, seed: int = 0):
    """(model, tokenizer): the same function of text under permuted token ids (special tokens kept)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    special = {t["id"] for t in spec["added_tokens"]}
    movable = sorted(i for i in vocab.values() if i not in special)
    gen = torch.Generator().manual_seed(seed)
    perm = {old: movable[j] for old, j in zip(movable, torch.randperm(len(movable), generator=gen).tolist())}
    spec["model"]["vocab"] = {tok: perm.get(i, i) for tok, i in vocab.items()}
    twin_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=tokenizer.eos_token,
                                       pad_token=tokenizer.pad_token, bos_token=tokenizer.bos_token)
    index = torch.arange(model.config.vocab_size)
    for old, new in perm.items():
        index[new] = old  # the twin's row new is the target's row old
    twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight[index])
        twin.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight[index])
    return twin.eval(), twin_tok


def other_tokenizer():
    """A byte-level BPE trained on prose, with a vocabulary of its own size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog.\n", "A return to the point of origin.\n"] * 30, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bridge")
    tok = tiny_tokenizer()
    save_tiny_lm(root / "target", tok, seed=0)
    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    twin, twin_tok = permuted_twin(target, tok)
    twin.save_pretrained(root / "twin", safe_serialization=True)
    twin_tok.save_pretrained(root / "twin")
    other = other_tokenizer()
    save_tiny_lm(root / "other", other, seed=5, layers=1, hidden=32)
    return root, target, tok, twin, twin_tok


def _reqs(tok, n):
    return [GenRequest(tok(f"def f{i}(a, b):\n    return a")["input_ids"], 10 + 4 * i) for i in range(n)]


@pytest.mark.parametrize("bsz", [1, 3])
def test_a_permuted_twin_drafts_the_targets_own_tokens(pair, bsz):
    _, target, tok, twin, twin_tok = pair
    assert tokenizer_fingerprint(twin_tok) != tokenizer_fingerprint(tok)
    reqs = _reqs(tok, bsz)
    plain = [r.token_ids for r in SpecEngine(target, tok, eos_ids=[]).generate(reqs)]
    res = SpecEngine(target, tok, TokenizerBridgeDrafter(twin, twin_tok, tok), num_draft=4, eos_ids=[]).generate(reqs)
    assert [r.token_ids for r in res] == plain
    drafted, accepted = (sum(r.stats[k] for r in res) for k in ("drafted_tokens", "accepted_tokens"))
    # the same function of text: its drafts are accepted where the target's own tokens are the canonical
    # encoding of its text (a random model often emits other splits of the same text, which re-encoding merges)
    assert drafted > 0 and accepted > 0


def test_sampling_keeps_the_target_distribution(pair):
    _, target, tok, twin, twin_tok = pair
    prompt = tok("def add(a, b):\n    return")["input_ids"]
    # T = 0.15: a few dozen pairs of first two tokens carry most of the mass, enough cells for the chi-square
    sampling = Sampling(temperature=0.15)
    engine = SpecEngine(target, tok, TokenizerBridgeDrafter(twin, twin_tok, tok), sampling, num_draft=2, seed=7, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(600)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0


def _decode(root, tmp_path, name, *flags):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def g{i}(x):\n    return x"}) + "\n" for i in range(3)))
    out = tmp_path / f"{name}.jsonl"
    res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(root / "target"), "--max-new-tokens", "12", *flags])
    return res, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.parametrize("draft", ["twin", "other"])
def test_decode_with_a_draft_of_another_tokenizer(pair, tmp_path, draft):
    root = pair[0]
    res, plain = _decode(root, tmp_path, "plain", "--drafter", "ar")
    assert res.exit_code == 0, res.output
    res, got = _decode(root, tmp_path, draft, "--drafter", str(root / draft), "--batch-size", "3")
    assert res.exit_code == 0, res.output
    assert [r["completion"] for r in got] == [r["completion"] for r in plain]
    assert sum(r["stats"]["drafted_tokens"] for r in got) > 0


def test_modes_that_need_the_drafts_distribution_are_refused(pair, tmp_path):
    root = pair[0]
    res, _ = _decode(root, tmp_path, "rsd", "--drafter", str(root / "other"), "--temperature", "0.7", "--verify", "rsd")
    assert res.exit_code != 0 and res.output.strip().startswith("error:") and "tokenizer of its own" in res.output
    res, _ = _decode(root, tmp_path, "pearl", "--drafter", str(root / "other"), "--parallel")
    assert res.exit_code != 0 and "tokenizer of its own" in res.output and "Traceback" not in res.output


def test_bench_times_a_draft_of_another_tokenizer_by_its_proposals(pair, tmp_path):
    """bench's drafting cost for such a draft is its measured propose time: its model reads its own ids, so
    timing it on the target's tokens (as for a draft that shares them) would index past its vocabulary."""
    root = pair[0]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def h{i}(x):\n    return x"}) + "\n" for i in range(2)))
    out = tmp_path / "r.json"
    res = invoke(["bench", "--in", str(src), "--target", str(root / "target"), "--methods", f"ar,{root / 'other'}",
                  "--max-new-tokens", "8", "--out", str(out)])
    assert res.exit_code == 0, res.output
    row = next(m for m in json.loads(out.read_text())["methods"] if m["method"] != "ar")
    assert row["identical_to_ar"] == 1.0 and row["draft_cost"] is not None
