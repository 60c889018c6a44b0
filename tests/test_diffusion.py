"""Diffusion decoding on tiny random dLLMs: the static reference, FreeDave's losslessness, invariants."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.models.artifacts import SpecdecError
from specdec.decode.diffusion.generator import DiffusionGenerator
from specdec.decode.diffusion.strategies import PUBLIC_STRATEGIES
from specdec.models.dllm import ConfidenceFilter, DllmSpec, save_filter
from specdec.decode.engine.types import GenRequest

VOCAB, MASK, EOS = 64, 63, 1
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models run fastest single-threaded; extra threads only contend on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_dllm(seed: int = 0, eos_boost: float = 0.0) -> LlamaForCausalLM:
    """A random 2-layer Llama in float64 (argmax ties and rounding cannot blur equality tests)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        # Make EOS a plausible prediction so end-of-text handling is exercised.
        model.lm_head.weight[EOS] += eos_boost * model.lm_head.weight.mean(0)
        model.lm_head.weight[EOS] *= 1 + eos_boost
    return model


def spec_for(attention: str, block: int = 8) -> DllmSpec:
    return DllmSpec(mask_token_id=MASK, eos_token_id=EOS, attention=attention, block_size=block, token_shift=True)


def requests(n: int, gen: int) -> list[GenRequest]:
    return [GenRequest(PROMPTS[i % len(PROMPTS)], gen) for i in range(n)]


def reference_static(model, prompt: list[int], gen: int, block: int, attention: str) -> list[int]:
    """LLaDA's low-confidence remasking, one token per step, written out plainly for one prompt."""
    p = len(prompt)
    x = prompt + [MASK] * gen
    n, context = len(x), p - 1  # with the token shift, slot q predicts token q + 1

    def attends(q: int, k: int) -> bool:
        if k <= q:
            return True
        if q < context:
            return False
        return attention == "bidirectional" or (k - context) // block <= (q - context) // block

    mask = torch.tensor([[attends(q, k) for k in range(n)] for q in range(n)])[None, None]
    for lo in range(p, n, block):
        hi = min(lo + block, n)
        while MASK in x[lo:hi]:
            logits = model(input_ids=torch.tensor([x]), attention_mask=mask).logits[0].double()
            logits[:, MASK] = float("-inf")
            best, best_conf, best_tok = None, -1.0, None
            for i in range(lo, hi):
                if x[i] == MASK:
                    probs = torch.softmax(logits[i - 1], -1)
                    if probs.max().item() > best_conf:
                        best, best_conf, best_tok = i, probs.max().item(), int(probs.argmax())
            x[best] = best_tok
            if best_tok == EOS:  # end-of-text: the rest of the block is EOS
                x[best:hi] = [EOS if t == MASK else t for t in x[best:hi]]
        if EOS in x[lo:hi]:
            break
    answer = x[p:]
    return answer[: answer.index(EOS)] if EOS in answer else answer


@pytest.mark.parametrize("attention", ["block", "bidirectional"])
def test_static_one_token_per_step_matches_reference(attention):
    model = tiny_dllm(eos_boost=2.5)
    gen = DiffusionGenerator(model, None, spec_for(attention), "static", gen_length=16, block_size=8)
    with torch.inference_mode():
        expected = [reference_static(model, p, 16, 8, attention) for p in PROMPTS]
    got = gen.generate(requests(3, 16))
    assert [r.token_ids for r in got] == expected
    assert any(len(t) < 16 for t in expected), "the EOS path should be exercised"


def confident_dllm() -> LlamaForCausalLM:
    """Every position predicts token 7 almost surely: attention/MLP outputs are zero, embeddings equal."""
    model = tiny_dllm()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(emb[0].expand_as(emb))
        model.lm_head.weight.zero_()
        model.lm_head.weight[7] = 50 * torch.sign(emb[0])
    return model


@pytest.mark.parametrize("batch", [1, 3])
def test_freedave_is_lossless(batch):
    model = tiny_dllm(seed=1, eos_boost=2.5)
    spec = spec_for("block")
    static = DiffusionGenerator(model, None, spec, "static", gen_length=24, block_size=8).generate(requests(batch, 24))
    dave = DiffusionGenerator(model, None, spec, "freedave", gen_length=24, block_size=8).generate(requests(batch, 24))
    assert [r.token_ids for r in dave] == [r.token_ids for r in static]
    assert dave[0].stats["target_calls"] <= static[0].stats["target_calls"]


def test_freedave_saves_forwards_when_drafts_agree():
    model, spec = confident_dllm(), spec_for("block")
    static = DiffusionGenerator(model, None, spec, "static", gen_length=24, block_size=8).generate(requests(3, 24))
    dave = DiffusionGenerator(model, None, spec, "freedave", gen_length=24, block_size=8, drafts=4).generate(requests(3, 24))
    assert [r.token_ids for r in dave] == [r.token_ids for r in static] == [[7] * 24] * 3
    assert static[0].stats["target_calls"] == 24
    # 3 segments x (1 segment-start forward + 8 tokens / 4 per verified draft forward)
    assert dave[0].stats["target_calls"] == 3 * (1 + 2)


def test_parallel_strategies_commit_many_tokens_on_a_confident_model():
    model, spec = confident_dllm(), spec_for("block")
    for strategy in ("threshold", "factor", "localleap", "credit", "entropy"):
        result = DiffusionGenerator(model, None, spec, strategy, gen_length=24, block_size=8).generate(requests(2, 24))
        assert result[0].token_ids == [7] * 24
        assert result[0].stats["steps"] == 3, strategy  # one step per segment


def strategy_kwargs(strategy: str, tmp_path) -> dict:
    if strategy != "learn2pd":
        return {}
    torch.manual_seed(0)
    save_filter(ConfidenceFilter(width=8), tmp_path / "filter", {"block_size": 8})  # wider than the block: padded
    return {"filter_dir": tmp_path / "filter", "threshold": 0.5}


def run_instrumented(gen: DiffusionGenerator, reqs: list[GenRequest]):
    events = []
    gen.on_step = events.append
    return gen.generate(reqs), events


INVARIANT_CASES = [(strategy, "none") for strategy in PUBLIC_STRATEGIES] + [("static", "prefix"), ("threshold", "dual"), ("freedave", "dual")]


@pytest.mark.parametrize("strategy,cache", INVARIANT_CASES)
def test_strategy_invariants(strategy, cache, tmp_path):
    model = tiny_dllm(seed=2, eos_boost=0.5)
    gen = DiffusionGenerator(
        model, None, spec_for("bidirectional"), strategy, gen_length=12, block_size=6, cache=cache, **strategy_kwargs(strategy, tmp_path)
    )
    reqs = [GenRequest(p, budget) for p, budget in zip(PROMPTS, (12, 9, 12))]
    results, events = run_instrumented(gen, reqs)
    first_commit: dict[tuple[int, int], int] = {}
    last_a0 = -1
    for event in events:
        assert event.a0 >= last_a0, "segments are decoded left to right"
        last_a0 = event.a0
        was_masked = event.before == MASK
        # Committed tokens are never rewritten; every row with work commits at least one token.
        assert torch.equal(event.after[~was_masked], event.before[~was_masked])
        new = was_masked & (event.after != MASK)
        assert bool((new.any(-1) | ~event.selectable.any(-1)).all())
        for r, col in new.nonzero().tolist():
            first_commit[(int(event.rows[r]), event.a0 + col)] = int(event.after[r, col])
    for row, result in enumerate(results):
        assert result.stats["approximate"] == (cache != "none")
        assert len(result.token_ids) <= reqs[row].max_new_tokens
        # The output is exactly what was committed, position by position.
        assert result.token_ids == [first_commit[(row, i)] for i in range(len(result.token_ids))]
        assert MASK not in result.token_ids


class LineTokenizer:
    """Just enough tokenizer for AdaBlock, which looks for line-break tokens in the vocabulary."""

    def __init__(self, newline: int):
        self.newline = newline

    def get_vocab(self):
        return {f"t{i}": i for i in range(VOCAB)}

    def convert_tokens_to_string(self, tokens):
        return "\n" if tokens == [f"t{self.newline}"] else tokens[0]


def test_adablock_composes_and_ends_windows_at_predicted_newlines():
    model = tiny_dllm(seed=3)
    plain = DiffusionGenerator(model, None, spec_for("block"), "threshold", gen_length=16, block_size=8)
    plain_results, plain_events = run_instrumented(plain, requests(2, 16))
    # Call the model's favourite output token a newline so AdaBlock has delimiters to act on.
    newline = max(set(plain_results[0].token_ids), key=plain_results[0].token_ids.count)
    ada = DiffusionGenerator(
        model, LineTokenizer(newline), spec_for("block"), "threshold", gen_length=16, block_size=8, adablock=True, adablock_threshold=0.0
    )
    assert ada.delimiters == [newline]
    results, events = run_instrumented(ada, requests(2, 16))
    narrowed = lambda e: bool(((e.before == MASK) & ~e.selectable).any())  # noqa: E731
    assert not any(narrowed(e) for e in plain_events)
    assert any(narrowed(e) for e in events), "a predicted newline should end a window early"
    assert [len(r.token_ids) for r in results] == [16, 16] or all(r.finish_reason == "stop" for r in results)


def test_bad_options_are_user_errors(tmp_path):
    model = tiny_dllm()
    with pytest.raises(SpecdecError, match="no option"):
        DiffusionGenerator(model, None, spec_for("block"), "threshold", bogus=1)
    with pytest.raises(SpecdecError, match="unknown diffusion strategy"):
        DiffusionGenerator(model, None, spec_for("block"), "nope")
    with pytest.raises(SpecdecError, match="filter"):
        DiffusionGenerator(model, None, spec_for("block"), "learn2pd")
    with pytest.raises(SpecdecError, match="cache"):
        DiffusionGenerator(model, None, spec_for("block"), "static", cache="full")
