"""Lexical Unit Decoding: train-lud lowers the unit loss; decoding at threshold 1 is the merged model's own
greedy decoding; a low threshold emits several tokens a step (and matches a cache-free recomputation);
the CLI writes an artifact whose records say approximate, and refuses sampling."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import invoke
from specdec.decode.approx.lud import LudDecoder, adapter_deltas, build, merged_copy
from specdec.decode.engine.types import GenRequest
from specdec.decode.options import DecodeOptions
from specdec.models.loading import load_target
from specdec.tests.test_train import make_tokenizer, tiny_cfg, write_decode_output
from specdec.train.trainers.lud import LudCollate, choose_placeholder, train_lud, unit_loss


def make_target(path):
    """A random Llama whose weights are large enough (init 0.2) that its greedy text varies with the context:
    equal outputs then say something."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(96, 0)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lud")
    make_target(root / "target")
    write_decode_output(root / "data.jsonl", n=120)
    metrics = train_lud(root / "target", [root / "data.jsonl"], root / "lud", tiny_cfg(steps=14, lr=1e-2, seq_len=32, batch=4),
                        cuts=8)
    return root, metrics


def _double_target(root):
    target, tok, _ = load_target(root / "target")
    return target.double().eval(), tok


def _prompts(tok):
    return [tok(t)["input_ids"] for t in ("the cat sat on the", "a dog", "one two three four five six")]


def test_packed_units_compute_what_separate_inputs_would():
    """One packed forward (block + placeholder groups under a 4-D mask) gives, at every unit position, the
    logits of the separate input x_1..x_t + placeholders; on a model mixing full and sliding-window layers
    whose window (8) is shorter than the block, with a BOS put in front."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from specdec.train.trainers.lud import MaskMaker, lud_forward

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=8, max_position_embeddings=128, sliding_window=8,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"], initializer_range=0.2,
                           bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).double().eval()
    m, bos, placeholder = 3, 2, 0
    ids = torch.randint(3, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    full = torch.cat([torch.full((2, 1), bos), ids], 1)  # a block as train.data.cut_blocks lays it out
    batch = LudCollate(5, m, 6, placeholder, skip=1).make(full, torch.Generator().manual_seed(2))
    assert torch.equal(batch["input_ids"][:, :31], full) and (batch["ntp_labels"][:, 0] == -100).all()
    with torch.no_grad():
        logits = lud_forward(model, batch, MaskMaker(model.config, model.dtype))
        for r in range(2):
            assert torch.allclose(logits[r, :31], model(input_ids=full[r : r + 1]).logits[0], atol=1e-10)
            pos, labels = batch["unit_pos"][r].view(-1, m), batch["unit_labels"][r].view(-1, m)
            for k in range(pos.shape[0]):
                cut = int(pos[k, 0]) + 1  # the tokens before the unit's placeholders
                assert cut >= 2 and labels[k].tolist() == full[r, cut : cut + m].tolist()
                alone = model(input_ids=torch.cat([full[r, :cut], torch.full((m - 1,), placeholder)])[None]).logits[0, -m:]
                assert torch.allclose(logits[r, pos[k]], alone, atol=1e-10)


def test_the_special_prefix_is_what_the_tokenizer_puts_in_front():
    from tokenizers.processors import TemplateProcessing

    from specdec.train.data import block_prefix

    tok = make_tokenizer(96, 0)
    assert block_prefix(tok) == []
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert block_prefix(tok) == [tok.bos_token_id]


def test_training_lowers_the_unit_loss_on_the_same_batch(workdir):
    from specdec.train.data import load_blocks

    root, metrics = workdir
    cfg = json.loads((root / "lud" / "config.json").read_text())
    assert cfg["specdec_kind"] == "lud" and cfg["unit_size"] == 3 and cfg["specdec_target"]["vocab_size"] > 0
    assert (root / "lud" / "adapter_model.safetensors").is_file() and not list((root / "lud").glob("*.bin"))
    target, tok, _ = load_target(root / "target")
    assert cfg["placeholder_id"] == choose_placeholder(tok) == tok.pad_token_id
    train, _ = load_blocks([root / "data.jsonl"], tok, 32, 0.15, 0)
    batch = LudCollate(123, 3, 8, cfg["placeholder_id"])([train[i] for i in range(4)])
    before = unit_loss(target, batch)
    merged = merged_copy(target, adapter_deltas(root / "lud"))
    after = unit_loss(merged, batch)
    assert after < before - 0.1, (before, after)
    # the held-out metrics agree
    assert metrics["heldout"]["unit_ce"] < metrics["heldout_before"]["unit_ce"]
    # checkpoints hold the adapter, not the frozen target
    from safetensors import safe_open

    ckpt = next((root / "lud" / "checkpoints").glob("step-*"))
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)


def test_resume_goes_on_from_an_adapter_only_checkpoint(tmp_path, workdir):
    root, _ = workdir
    out = tmp_path / "lud"
    first = train_lud(root / "target", [root / "data.jsonl"], out, tiny_cfg(steps=3, seq_len=32, batch=4), cuts=4)
    assert first["steps"] == 3
    again = train_lud(root / "target", [root / "data.jsonl"], out, tiny_cfg(steps=5, seq_len=32, batch=4), cuts=4, resume=True)
    assert again["steps"] == 5 and len(again["loss_curve"]) == 5 and again["loss_curve"][:3] == first["loss_curve"]


def test_threshold_one_is_the_merged_models_greedy_decoding(workdir):
    from peft import PeftModel

    root, _ = workdir
    target, tok = _double_target(root)
    q_before = target.model.layers[0].self_attn.q_proj.weight.clone()
    decoder = build(root / "lud", target, tok, DecodeOptions(unit_threshold=1.0))
    assert isinstance(decoder, LudDecoder) and decoder.approximate
    # the caller's target is untouched; the merged copy differs where the LoRA is
    assert torch.equal(target.model.layers[0].self_attn.q_proj.weight, q_before)
    assert not torch.equal(decoder.merged.model.layers[0].self_attn.q_proj.weight, q_before)
    assert decoder.merged.lm_head is target.lm_head  # everything else is shared
    prompts = _prompts(tok)
    results = decoder.generate([GenRequest(p, 16) for p in prompts])
    assert len({t for r in results for t in r.token_ids}) >= 8  # text that varies: equality below says something
    reference_model = PeftModel.from_pretrained(_double_target(root)[0], str(root / "lud")).merge_and_unload().eval()
    for p, res in zip(prompts, results):
        assert res.stats["tokens_per_step"] == 1 and res.stats["units"] == res.stats["new_tokens"] == len(res.token_ids)
        assert res.stats["target_calls"] == res.stats["units"] and res.stats["approximate"] is True
        ids = torch.tensor([p], device=reference_model.device)
        with torch.no_grad():
            out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert res.token_ids == out[0, len(p):].tolist()


def _uncached_units(model, prompt, placeholder, m, steps):
    """Each step recomputed from scratch: the whole text so far plus m-1 placeholders, all m argmaxes taken."""
    seq = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq + [placeholder] * (m - 1)], device=model.device)).logits[0, -m:]
        seq += logits.argmax(-1).tolist()
    return seq[len(prompt):]


def test_a_low_threshold_emits_several_tokens_a_step_as_recomputed_without_a_cache(workdir):
    root, _ = workdir
    target, tok = _double_target(root)
    # every distribution over V tokens has a top probability of at least 1/V: each step emits the whole unit
    low = 0.5 / len(tok)
    decoder = build(root / "lud", target, tok, DecodeOptions(unit_threshold=low))
    prompts = _prompts(tok)
    results = decoder.generate([GenRequest(p, 12) for p in prompts])
    eos = tok.eos_token_id
    for p, res in zip(prompts, results):
        assert res.stats["approximate"] is True
        want = _uncached_units(decoder.merged, p, decoder.placeholder, 3, 4)[:12]
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert res.token_ids == want
    tps = [r.stats["tokens_per_step"] for r in results]
    assert sum(tps) / len(tps) > 1
    # the default threshold (0.9) lies between
    assert build(root / "lud", target, tok, DecodeOptions()).threshold == 0.9


def test_an_artifact_for_another_tokenizer_is_refused(workdir):
    from specdec.models.artifacts import SpecdecError
    from specdec.tests.test_train import make_tokenizer

    root, _ = workdir
    target, _ = _double_target(root)
    with pytest.raises(SpecdecError, match="another tokenizer"):
        build(root / "lud", target, make_tokenizer(80, seed=1), DecodeOptions())


def test_cli_train_lud_then_decode_writes_approximate_records(tiny_family, tmp_path):
    data = write_decode_output(tmp_path / "data.jsonl", n=80)
    out = tmp_path / "lud"
    res = invoke(["train-lud", "--target", tiny_family / "target", "--data", data, "--out", out, "--max-steps", "3",
                  "--batch-size", "2", "--seq-len", "24", "--checkpoint-every", "0"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["specdec_kind"] == "lud"
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):\n", "import os\n", "class A:\n")))
    for extra in ([], ["--unit-threshold", "0.001"]):
        dst = tmp_path / f"o{len(extra)}.jsonl"
        res = invoke(["decode", "--in", prompts, "--out", dst, "--target", tiny_family / "target", "--drafter", out,
                      "--max-new-tokens", "9", *extra])
        assert res.exit_code == 0, res.output
        records = [json.loads(line) for line in dst.read_text().splitlines()]
        assert len(records) == 3 and all(r.get("approximate") is True for r in records), records
        if extra:
            tps = [r["stats"]["tokens_per_step"] for r in records]
            assert sum(tps) / len(tps) > 1, tps
    res = invoke(["decode", "--in", prompts, "--out", tmp_path / "t.jsonl", "--target", tiny_family / "target", "--drafter", out,
                  "--temperature", "0.7"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.stderr
