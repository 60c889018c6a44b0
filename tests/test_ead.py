"""Entropy Adaptive Decoding (``ead:DRAFT``, approximate): the draft generates while its rolling entropy is
at or below the threshold, the target (catching up in one forward) while it is above; threshold 0 is the
target's greedy decoding, inf the draft's."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama

from specdec.decode.approx import ead
from specdec.decode.approx.ead import EadDecoder, entropy
from specdec.decode.engine.types import GenRequest
from specdec.decode.options import DecodeOptions
from specdec.models.errors import SpecdecError, UsageError

PROMPTS = make_prompts(4, seed=3)
BUDGETS = [20, 9, 25, 14]  # rows finish at different times
# the tiny draft's next-token entropies lie around 4.0-4.35 nats (96 tokens: at most ln 96 = 4.56): this
# threshold sends some steps of every row to each model
MIDDLE = 4.15


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(seed=0), tiny_llama(seed=1, layers=1, hidden=32)


def requests():
    return [GenRequest(p, n) for p, n in zip(PROMPTS, BUDGETS)]


def decoder(pair, threshold, window=None):
    target, draft = pair
    return EadDecoder(target, ByteTokenizer(), DecodeOptions(), draft, threshold=threshold, window=window)


def greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def naive_ead(pair, prompt, n, threshold, window):
    """EAD without caches: every step the draft reads the whole text, the target too when it emits."""
    target, draft = pair
    seq, entropies, out, by_target = list(prompt), [], [], 0
    with torch.no_grad():
        for _ in range(n):
            logits = draft(torch.tensor([seq])).logits[0, -1]
            entropies.append(float(entropy(logits)))
            recent = entropies[-window:]
            if sum(recent) / len(recent) > threshold:
                tok, by_target = int(target(torch.tensor([seq])).logits[0, -1].argmax()), by_target + 1
            else:
                tok = int(logits.argmax())
            seq.append(tok)
            out.append(tok)
            if tok == 2:
                break
    return out, by_target


def test_threshold_zero_is_the_targets_greedy_decoding(pair):
    got = decoder(pair, 0.0).generate(requests())
    assert [r.token_ids for r in got] == [greedy(pair[0], p, n) for p, n in zip(PROMPTS, BUDGETS)]
    for r in got:
        s = r.stats
        assert s["approximate"] is True and s["target_share"] == 1.0 and s["target_tokens"] == s["new_tokens"] == len(r.token_ids)
        assert s["target_calls"] == s["new_tokens"] and s["draft_calls"] == 0  # the draft decides nothing at 0


def test_threshold_inf_is_the_drafts_greedy_decoding(pair):
    got = decoder(pair, math.inf).generate(requests())
    assert [r.token_ids for r in got] == [greedy(pair[1], p, n) for p, n in zip(PROMPTS, BUDGETS)]
    for r in got:
        s = r.stats
        assert s["target_calls"] == s["target_tokens"] == 0 and s["target_share"] == 0.0
        assert s["draft_calls"] == s["new_tokens"]  # its prefill, then one step per token it emitted but the last


@pytest.mark.parametrize("window", [1, 3])
def test_a_middle_threshold_mixes_the_models_as_the_cache_free_reference_does(pair, window):
    """Batched rows with caches (the target catching up on what the draft emitted) decode what the
    cache-free reference decodes one row at a time, and both models emit tokens in some rows."""
    got = decoder(pair, MIDDLE, window).generate(requests())
    shares = []
    for r, p, n in zip(got, PROMPTS, BUDGETS):
        tokens, by_target = naive_ead(pair, p, n, MIDDLE, window)
        assert r.token_ids == tokens
        s = r.stats
        assert s["target_tokens"] == by_target and s["new_tokens"] == len(tokens)
        assert s["target_share"] == pytest.approx(by_target / len(tokens), abs=1e-6)
        # one target forward per token it emits, its catch-up on the draft's tokens included
        assert s["target_calls"] == s["target_tokens"] and s["draft_calls"] == s["new_tokens"]
        shares.append(s["target_share"])
    assert sum(0 < s < 1 for s in shares) >= 2, shares
    # and the mix is neither model's own decoding
    assert [r.token_ids for r in got] != [greedy(pair[0], p, n) for p, n in zip(PROMPTS, BUDGETS)]
    assert [r.token_ids for r in got] != [greedy(pair[1], p, n) for p, n in zip(PROMPTS, BUDGETS)]


def test_one_request_at_a_time_decodes_what_the_batch_does(pair):
    batch = decoder(pair, MIDDLE, 2).generate(requests())
    one = decoder(pair, MIDDLE, 2)
    assert [one.generate([q])[0].token_ids for q in requests()] == [r.token_ids for r in batch]


def test_entropy_in_nats_ignores_tokens_of_probability_zero():
    uniform = torch.zeros(2, 8, dtype=torch.float64)
    uniform[1, 4:] = float("-inf")  # a reduced vocabulary's draft: logits -inf outside its tokens
    assert entropy(uniform).tolist() == pytest.approx([math.log(8), math.log(4)])
    assert float(entropy(torch.tensor([0.0, -1e4]))) == pytest.approx(0.0, abs=1e-6)


def test_defaults_and_bad_values(pair):
    d = decoder(pair, None)
    assert (d.threshold, d.window) == (ead.DEFAULT_THRESHOLD, ead.DEFAULT_WINDOW)
    assert d.approximate and d.model is pair[1]
    with pytest.raises(UsageError):
        decoder(pair, 1.0, 0)
    with pytest.raises(UsageError):
        decoder(pair, -1.0)


def test_spec_names_a_draft_model(tiny_family):
    from specdec.decode.drafters.registry import ead_draft

    draft = str(tiny_family / "draft")
    assert str(ead_draft(f"ead:{draft}").source) == draft
    for spec in ("ead", "ead:", "ead: ", "ead:ngram", "ead:layerskip:1"):
        with pytest.raises(UsageError):
            ead_draft(spec)
    with pytest.raises(SpecdecError):
        ead_draft(f"ead:{tiny_family / 'no-such-draft'}")


# -- the CLI --------------------------------------------------------------------------------------------

RECORDS = [{"prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(4)]


def _decode(tiny_family, tmp_path, name, *args):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / f"{name}.jsonl"
    res = invoke(["decode", "--in", src, "--out", out, "--target", tiny_family / "target", "--max-new-tokens", "10",
                  "--batch-size", "3", *args])
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return res, records


def test_cli_threshold_zero_writes_the_plain_decodings_text_marked_approximate(tiny_family, tmp_path):
    res, plain = _decode(tiny_family, tmp_path, "ar", "--drafter", "ar")
    assert res.exit_code == 0, res.output
    res, mixed = _decode(tiny_family, tmp_path, "ead", "--drafter", f"ead:{tiny_family / 'draft'}", "--entropy-threshold", "0")
    assert res.exit_code == 0, res.output
    assert [o["completion"] for o in mixed] == [o["completion"] for o in plain]
    assert all(o["approximate"] is True and o["stats"]["target_share"] == 1.0 for o in mixed)
    assert not any("approximate" in o for o in plain)


def test_cli_refuses_a_missing_or_foreign_draft(tiny_family, tmp_path):
    res, records = _decode(tiny_family, tmp_path, "none", "--drafter", "ead:")
    assert res.exit_code == 2 and not records
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] and "ead:DRAFT" in res.output
    res, records = _decode(tiny_family, tmp_path, "foreign", "--drafter", f"ead:{tiny_family / 'foreign-draft'}")
    assert res.exit_code == 1 and "another tokenizer" in res.output and not records  # the registry's check
