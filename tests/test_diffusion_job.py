"""`specdec decode` on a masked-diffusion LM: the same JSONL contract, error records and batching."""

from __future__ import annotations

import json

import pytest
from conftest import invoke
import torch
from test_train_dllm import FAST, TINY, task_pairs, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.train.trainers.dllm import train_dllm


@pytest.fixture(scope="module")
def dllm_dir(tmp_path_factory):
    ar = tmp_path_factory.mktemp("ar")
    tok = word_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, **TINY)).save_pretrained(ar)
    tok.save_pretrained(ar)
    out = tmp_path_factory.mktemp("dllm")
    train_dllm(ar, ["apple pear fig " * 20], out, block_size=8, max_steps=4, extra_examples=task_pairs(20), **FAST)
    return out


def test_decode_routes_a_dllm_to_diffusion_decoding(dllm_dir, tmp_path):
    rows = [{"id": "a", "prompt": "copy : apple pear"}, "{broken", {"id": "b", "prompt": ""}, {"id": "c", "prompt": "reverse : fig apple"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    outs = {}
    for strategy in ["static", "threshold+tau=0.5", "freedave"]:
        out = tmp_path / f"{strategy.split('+')[0]}.jsonl"
        res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(dllm_dir),
                                       "--strategy", strategy, "--gen-length", "16", "--block-size", "8", "--batch-size", "2"])
        assert res.exit_code == 3, res.output  # two bad records
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert [o["id"] for o in got] == ["a", "2", "b", "c"]
        assert "malformed JSON" in got[1]["error"] and "empty prompt" in got[2]["error"]
        for o in (got[0], got[3]):
            assert o["stats"]["strategy"] == strategy.split("+")[0] and o["stats"]["steps"] >= 1
        outs[strategy] = [got[0]["completion"], got[3]["completion"]]
        # The summary counts diffusion tokens and reports steps per token, not a speculative tau.
        decoded = got[0]["stats"]["decoded_tokens"] + got[3]["stats"]["decoded_tokens"]
        assert f"{decoded} tokens in" in " ".join(res.output.split()), res.output
        assert "denoising steps per token" in res.output
    assert outs["freedave"] == outs["static"]  # lossless strategy, through the whole job


def test_bench_on_a_dllm_times_like_the_ar_bench_and_records_provenance(dllm_dir, tmp_path, monkeypatch):
    """`specdec bench` on a dLLM: interleaved passes, speedups as the median of per-pass ratios to static."""
    import specdec
    from specdec.bench.report import cli_command

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["copy : apple pear", "reverse : fig apple", "copy : fig"]))
    args = ["bench", "--in", str(src), "--target", str(dllm_dir), "--methods", "freedave,threshold+tau=0.5",
            "--max-new-tokens", "8", "--batch-size", "2", "--repeats", "2", "--warmup", "0", "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr("sys.argv", ["specdec", *args])
    res = invoke(args)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["kind"] == "diffusion" and report["command"] == cli_command()
    assert report["specdec_version"] == specdec.__version__ and report["date"] and report["machine"]["cores"] >= 1
    rows = {row["method"]: row for row in report["methods"]}
    assert list(rows) == ["static", "freedave", "threshold+tau=0.5"]
    assert all(len(row["walls_s"]) == 2 for row in rows.values())
    assert rows["static"]["speedup"] == 1.0 and rows["freedave"]["exact_match"] == 1.0
    assert report["config"]["gen_length"] == 8 and report["config"]["repeats"] == 2
