"""SkipDecode (``skipdecode[:FIRST,LAST]``, approximate): the prompt runs every layer, generation step t
only the top n_t, n_t falling linearly from FIRST to LAST over the budget, batch-wide; no key or value is
recomputed. FIRST = LAST = L is the target's greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from transformers.cache_utils import DynamicCache

from specdec.decode.approx import skipdecode
from specdec.decode.approx.skipdecode import SkipDecoder, schedule
from specdec.decode.drafters.self_speculation import layer_skip_view
from specdec.decode.engine.types import GenRequest
from specdec.decode.options import DecodeOptions
from specdec.models import arch
from specdec.models.errors import UsageError

LAYERS, NEW = 6, 20
PROMPTS = make_prompts(4, seed=3)  # 17 to 37 tokens: rows are left-padded, and longer than gemma3's window


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gemma3(seed: int = 0):
    """Hybrid sliding (window 8) / full attention layers, as Gemma 3 270M's 18."""
    torch.manual_seed(seed)
    sliding, full = arch.SLIDING, arch.FULL
    cfg = tf.Gemma3TextConfig(vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                              hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                              max_position_embeddings=256, layer_types=[sliding, sliding, full] * 2)
    model = tf.AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


MODELS = {"llama": lambda: tiny_llama(seed=3, layers=LAYERS), "gemma3": tiny_gemma3}


@pytest.fixture(scope="module")
def models():
    return {name: build() for name, build in MODELS.items()}


def decoder(model, first=None, last=None):
    return SkipDecoder(model, ByteTokenizer(), DecodeOptions(), first, last)


def requests(budget=NEW):
    return [GenRequest(p, budget) for p in PROMPTS]


def greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference(model, prompt, budget, first, last):
    """One row through transformers' own DynamicCache (its sliding layers keep only the window), each step a
    view of the top n_t layers over the cache's top n_t layers."""
    layers = model.config.num_hidden_layers
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for t, n in enumerate(schedule(first, last, budget)):
            if tokens[-1] == 2:
                break
            view = model if n == layers else layer_skip_view(model, list(range(layers - n)))
            top = DynamicCache()
            top.layers = cache.layers[layers - n :]
            out = view(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[len(prompt) + t]]), past_key_values=top, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_schedule_is_linear_and_never_grows():
    assert schedule(6, 3, 10) == [6, 6, 5, 5, 4, 4, 4, 3, 3]  # 9 steps after the prompt's forward
    assert schedule(18, 9, 2) == [18] and schedule(18, 9, 1) == [] and schedule(4, 4, 5) == [4] * 4
    for first, last, budget in [(18, 9, 64), (18, 1, 7), (5, 2, 100), (3, 3, 9)]:
        n = schedule(first, last, budget)
        assert len(n) == budget - 1 and n[0] == first and n[-1] == last
        assert all(a >= b for a, b in zip(n, n[1:]))


@pytest.mark.parametrize("spec, error", [("skipdecode:4", "FIRST,LAST"), ("skipdecode:a,b", "FIRST,LAST"),
                                         ("skipdecode:2,3", "FIRST >= LAST"), ("skipdecode:3,0", "LAST >= 1"),
                                         ("skipdecode:1,2,3", "FIRST,LAST")])
def test_bad_specs_are_refused_before_any_model(spec, error):
    with pytest.raises(UsageError, match=error):
        skipdecode.check_spec(spec)


def test_spec_and_defaults(models):
    assert skipdecode.check_spec("skipdecode") is None and skipdecode.check_spec("skipdecode:6,2") == (6, 2)
    d = decoder(models["llama"])
    assert (d.first, d.last, d.approximate) == (LAYERS, LAYERS // 2, True)
    assert (decoder(tiny_llama(layers=3)).first, decoder(tiny_llama(layers=3)).last) == (3, 2)  # ceil(L / 2)
    with pytest.raises(UsageError, match="at most 6"):
        skipdecode.build("skipdecode:7,1", models["llama"], ByteTokenizer(), DecodeOptions())


@pytest.mark.parametrize("name", list(MODELS))
def test_all_layers_throughout_is_greedy_decoding(models, name):
    model = models[name]
    got = decoder(model, LAYERS, LAYERS).generate(requests())
    assert [r.token_ids for r in got] == [greedy(model, p, NEW) for p in PROMPTS]
    assert all(r.stats["layers_run"] == LAYERS and r.stats["approximate"] is True for r in got)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("first, last", [(6, 2), (4, 1)])
def test_a_batch_decodes_each_row_as_alone_and_as_transformers_cache_does(models, name, first, last):
    """Left-padded rows of different lengths decode what each decodes alone at the same schedule, and what
    transformers' DynamicCache does (a sliding window shorter than the prompts: masks and positions hold)."""
    model = models[name]
    d = decoder(model, first, last)
    batch = [r.token_ids for r in d.generate(requests())]
    assert batch == [d.generate([q])[0].token_ids for q in requests()]
    assert batch == [reference(model, p, NEW, first, last) for p in PROMPTS]
    assert batch != [greedy(model, p, NEW) for p in PROMPTS]  # skipping layers changed the text


def test_requests_of_other_budgets_run_on_their_own_schedules(models):
    d = decoder(models["llama"], 6, 1)
    reqs = [GenRequest(p, n) for p, n in zip(PROMPTS, [NEW, 7, NEW, 12])]
    got = d.generate(reqs)
    assert [r.token_ids for r in got] == [d.generate([q])[0].token_ids for q in reqs]
    assert [len(r.token_ids) for r in got] == [NEW, 7, NEW, 12]


def count_layer_calls(model):
    """Per forward of the model (or of a layer-skip view of it), the indices of the decoder layers it ran:
    the views' layers are shallow copies sharing the layers' hooks, as they share the final norm."""
    forwards, current = [], []
    layers = arch.decoder_layers(model)[2]
    handles = [layer.register_forward_hook(lambda *_, i=i: current.append(i)) for i, layer in enumerate(layers)]

    def end(*_):
        forwards.append(list(current))
        current.clear()

    handles.append(model.model.norm.register_forward_hook(end))
    return forwards, handles


@pytest.mark.parametrize("name", list(MODELS))
def test_later_steps_run_only_the_top_layers(models, name):
    model = models[name]
    budget = 12
    d = decoder(model, 5, 1)
    forwards, handles = count_layer_calls(model)
    try:
        (result,) = d.generate([GenRequest(PROMPTS[0], budget)])
    finally:
        for h in handles:
            h.remove()
    assert len(result.token_ids) == budget  # (no EOS in this row: every step ran)
    expected = schedule(5, 1, budget)
    assert forwards[0] == list(range(LAYERS))  # the prompt: every layer
    assert [len(f) for f in forwards[1:]] == expected
    assert all(f == list(range(LAYERS - n, LAYERS)) for f, n in zip(forwards[1:], expected))  # the top n_t, bottom ones bypassed
    counts = [len(f) for f in forwards]
    assert all(a >= b for a, b in zip(counts, counts[1:])) and counts[-1] == 1
    s = result.stats
    assert s["approximate"] is True and s["target_calls"] == budget == len(forwards)
    assert s["layers_run"] == pytest.approx(sum(counts) / budget) and s["layers_run"] < LAYERS


# -- the CLI --------------------------------------------------------------------------------------------


def _decode(tiny_family, tmp_path, name, *args):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(3)))
    out = tmp_path / f"{name}.jsonl"
    res = invoke(["decode", "--in", src, "--out", out, "--target", tiny_family / "target", "--max-new-tokens", "8", *args])
    return res, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_cli_all_layers_is_plain_decoding_marked_approximate(tiny_family, tmp_path):
    res, plain = _decode(tiny_family, tmp_path, "ar")
    assert res.exit_code == 0, res.output
    res, skipped = _decode(tiny_family, tmp_path, "skip", "--drafter", "skipdecode:2,2")  # the tiny target has 2 layers
    assert res.exit_code == 0, res.output
    assert [o["completion"] for o in skipped] == [o["completion"] for o in plain]
    assert all(o["approximate"] is True and o["stats"]["layers_run"] == 2 for o in skipped)


def test_cli_more_layers_than_the_target_has_is_a_usage_error(tiny_family, tmp_path):
    res, records = _decode(tiny_family, tmp_path, "bad", "--drafter", "skipdecode:9,1")
    assert res.exit_code == 2 and not records
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 decoder layers" in errors[0]
