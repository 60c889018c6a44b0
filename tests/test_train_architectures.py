"""Trainers on non-Llama targets: train-draft, train-heads (medusa, clover, eagle) and
train-acceptance run a few steps, and their artifacts decode greedy-identically to plain decoding."""

import json

import pytest
import torch
from conftest import tiny_tokenizer

from specdec.decode.engine.loop import SpecEngine
from specdec.decode.options import DecodeOptions
from specdec.decode.drafters.registry import build_drafter
from specdec.decode.engine.types import GenRequest
from specdec.models.loading import Placement, load_target
from specdec.train.loop import TrainConfig


def _save(path, config, tokenizer, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _configs(vocab, eos, pad):
    from transformers import GPTNeoXConfig, Qwen2Config

    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, max_position_embeddings=256)
    return {
        "qwen2": Qwen2Config(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False, **common),
        "gpt_neox": GPTNeoXConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                  tie_word_embeddings=False, **common),
    }


@pytest.fixture(scope="module", params=["qwen2", "gpt_neox"])
def workdir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    tok = tiny_tokenizer()
    cfg = _configs(len(tok), tok.eos_token_id, tok.pad_token_id)[request.param]
    _save(root / "target", cfg, tok)
    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n", "class P:\n    x = 1\n"]
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": t * 6}) + "\n" for t in text * 20))
    return root


def _cfg(**kw):
    base = dict(steps=3, batch=4, seq_len=32, lr=1e-3, warmup=1, checkpoint_every=0, heldout=0.2, mixed_precision="no", progress=False)
    return TrainConfig(**{**base, **kw})


def _identical_to_plain(workdir, spec, options=None):
    target, tok, _ = load_target(workdir / "target", Placement(device="cpu"))
    opts = options or DecodeOptions(device="cpu")
    prompts = [tok(p)["input_ids"] for p in ("def add(a, b):\n", "for i in range(3):\n    print(", "class P:\n")]
    reqs = [GenRequest(p, 12) for p in prompts]
    plain = SpecEngine(target, tok, eos_ids=[]).generate(reqs)
    got = SpecEngine(target, tok, build_drafter(spec, target, tok, opts), eos_ids=[]).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]


def test_train_draft_on_a_non_llama_target_decodes_losslessly(workdir):
    from specdec.train.trainers.draft import train_draft

    metrics = train_draft(workdir / "target", [workdir / "data.jsonl"], workdir / "draft", _cfg(), arch="layers=1,hidden=32,heads=4")
    assert metrics["steps"] == 3
    _identical_to_plain(workdir, str(workdir / "draft"))


@pytest.mark.parametrize("kind", ["medusa", "clover", "eagle"])
def test_train_heads_on_a_non_llama_target_decode_losslessly(workdir, kind):
    from specdec.train.trainers.heads import train_heads

    extra = {"window": 16} if kind == "clover" else {}
    metrics = train_heads(kind, workdir / "target", [workdir / "data.jsonl"], workdir / kind, _cfg(), **extra)
    assert metrics["steps"] == 3
    _identical_to_plain(workdir, str(workdir / kind))


def test_train_acceptance_on_a_non_llama_target_decodes_losslessly(workdir):
    from specdec.train.trainers.acceptance import train_acceptance
    from specdec.train.trainers.draft import train_draft

    if not (workdir / "draft" / "config.json").exists():
        train_draft(workdir / "target", [workdir / "data.jsonl"], workdir / "draft", _cfg(), arch="layers=1,hidden=32,heads=4")
    train_acceptance(workdir / "target", workdir / "draft", [workdir / "data.jsonl"], workdir / "acceptance",
                     _cfg(budget_minutes=0.15), greedy_sequences=8, cost_reps=1)
    _identical_to_plain(workdir, str(workdir / "draft"), DecodeOptions(device="cpu", acceptance=str(workdir / "acceptance")))
