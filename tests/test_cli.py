"""One CLI: every bad value of an enumerated option, and every option that does not apply to the
chosen model or drafter, is a usage error: exit 2 and one ``error:`` line, before any work."""

import json

import pytest
from conftest import invoke


@pytest.fixture()
def prompts(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    return src


def _assert_usage_error(res, needle: str):
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args,needle", [
    (["--tree", "foo"], "--tree"),
    (["--kernels", "cuda9"], "--kernels"),
    (["--cache", "everything"], "--cache"),
    (["--dtype", "fp8"], "--dtype"),
    (["--drafter", "layerskip:a,b"], "layerskip"),
    (["--stop-threshold", "1.5", "--acceptance", "x"], "--stop-threshold"),
    (["--num-draft", "0"], "--num-draft"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", "-5"], "--max-new-tokens"),
    (["--top-p", "2"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--prefill-chunk", "-1"], "--prefill-chunk"),
    (["--prefill-chunk", "8", "--schedule", "static"], "--prefill-chunk"),
])
def test_bad_decode_values_are_usage_errors(tiny_family, prompts, tmp_path, args, needle):
    res = invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", *args])
    _assert_usage_error(res, needle)
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()


@pytest.mark.parametrize("args,needle", [
    (["--drafter", "ngram", "--tree", "dynamic"], "--tree"),
    (["--drafter", "ngram", "--tree-tokens", "16"], "--tree"),
    (["--drafter", "ngram", "--acceptance", "acceptance"], "--acceptance"),
    (["--stop-threshold", "0.3"], "--acceptance"),
    (["--strategy", "threshold"], "diffusion"),
    (["--cache", "prefix"], "diffusion"),
])
def test_options_that_do_not_apply_to_a_causal_lm_are_refused(tiny_family, prompts, tmp_path, args, needle):
    res = invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", *args])
    _assert_usage_error(res, needle)


@pytest.mark.parametrize("argv,needle", [
    (["train-heads", "--kind", "hydra"], "--kind"),
    (["train-draft", "--mixed-precision", "fp64"], "--mixed-precision"),
    (["train-draft", "--lora-save", "pickle"], "--lora-save"),
    (["export", "x", "--to", "onnx"], "--to"),
    (["recipe", "run", "tiny-stdlib", "--only", "everything"], "--only"),
    (["bench", "--kernels", "x"], "--kernels"),
])
def test_bad_values_on_every_command_are_usage_errors(tmp_path, argv, needle):
    common = {"train-heads": ["--target", "t", "--data", "d", "--out", "o"], "train-draft": ["--target", "t", "--data", "d", "--out", "o"]}
    res = invoke([*argv, *common.get(argv[0], [])])
    _assert_usage_error(res, needle)


def test_help_is_instant_and_lists_decode_first():
    res = invoke(["--help"])
    assert res.exit_code == 0
    text = res.stdout + res.stderr
    assert text.index("decode") < text.index("train-draft")


def test_verify_schemes_apply_to_draft_models_only(tiny_family, prompts, tmp_path):
    _assert_usage_error(invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target",
                                "--drafter", "ngram", "--verify", "rsd"]), "--verify")
    _assert_usage_error(invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target",
                                "--verify", "magic"]), "--verify")
    res = invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", "--drafter",
                  tiny_family / "draft", "--verify", "spectr", "--top-k", "2", "--temperature", "0.7", "--max-new-tokens", "6"])
    assert res.exit_code == 0, res.output


def test_an_unknown_method_or_drafter_is_a_usage_error_before_anything_loads(tiny_family, prompts, tmp_path, monkeypatch):
    """A name that is no drafter, no strategy and no local hub model is refused before the default target is
    even asked for (no download attempt, no model loaded)."""
    import specdec.cli.main as cli_main
    from specdec.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli_main, "default_target", lambda console: pytest.fail("the default target was asked for"))
    monkeypatch.setattr(loading, "load_causal_lm", no_load)
    _assert_usage_error(invoke(["bench", "--in", prompts, "--methods", "ar,nosuchmethod"]), "nosuchmethod")
    _assert_usage_error(invoke(["bench", "--in", prompts, "--target", tiny_family / "target", "--methods", "ar,nosuchmethod"]),
                        "nosuchmethod")
    _assert_usage_error(invoke(["bench", "--in", prompts, "--methods", "ngram+tree-tokens=8"]), "--tree-tokens")
    _assert_usage_error(invoke(["bench", "--in", prompts, "--methods", "hf-nothing"]), "hf-nothing")
    _assert_usage_error(invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--drafter", "nosuchdrafter"]),
                        "nosuchdrafter")
    assert not (tmp_path / "o.jsonl").exists()


def test_a_llamacpp_build_that_crashes_here_is_one_error_line_before_any_model_loads(tiny_family, prompts, monkeypatch,
                                                                                       tmp_path):
    """llama.cpp runs inside the bench's process: a build that dies on this CPU (AMX on a virtual machine that
    does not allow it) would take every method measured before it down too. A child process decodes two
    tokens first; its death is one error line (exit 1) naming the signal and a rebuild, before anything loads."""
    import importlib.util
    from pathlib import Path

    from specdec.bench import llamacpp
    from specdec.models import loading

    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    monkeypatch.setattr(llamacpp, "gguf_file", lambda source, spec: tmp_path / "model.gguf")
    monkeypatch.setattr(llamacpp, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    res = invoke(["bench", "--in", prompts, "--target", tiny_family / "target", "--methods", "ar,ngram,llamacpp"])
    assert res.exit_code == 1, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: llamacpp: llama.cpp crashed (SIGSEGV)"), res.stderr
    assert "GGML_AMX_TILE=OFF" in lines[0] and "Traceback" not in res.output
    # a child that fails without a signal: its last line; one that decodes: nothing to say
    monkeypatch.setattr(llamacpp, "PROBE", "raise SystemExit('no such file')")
    with pytest.raises(llamacpp.SpecdecError, match="exit 1.*no such file"):
        llamacpp.probe("llamacpp", Path("model.gguf"))
    monkeypatch.setattr(llamacpp, "PROBE", "import sys; assert sys.argv[1:] == ['model.gguf', '1']")
    llamacpp.probe("llamacpp", Path("model.gguf"))


@pytest.mark.parametrize("args,needle", [
    (["--drafter", "ngram", "--pre-verify"], "--pre-verify applies to draft models with --parallel"),
    (["--drafter", "ngram", "--verify", "rsd"], "--verify applies to draft models"),
    (["--max-draft", "3"], "--max-draft applies to draft models with --acceptance"),
])
def test_what_does_not_apply_says_where_it_applies(tiny_family, prompts, tmp_path, args, needle):
    res = invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", *args])
    _assert_usage_error(res, needle)


def test_llamacpp_peers_are_refused_without_llama_cpp_or_a_gguf_target(tiny_family, prompts, monkeypatch):
    """--methods llamacpp: one error line, before any model loads, when llama-cpp-python is absent, and when
    the target is not a GGUF file (llama.cpp reads only those)."""
    import importlib.util

    from specdec.models import loading

    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    for spec in ("llamacpp", "llamacpp-lookup"):
        _assert_usage_error(invoke(["bench", "--in", prompts, "--target", tiny_family / "target", "--methods", f"ar,{spec}"]),
                            "specdec[peers]")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    _assert_usage_error(invoke(["bench", "--in", prompts, "--target", tiny_family / "target", "--methods", "ar,llamacpp"]),
                        "GGUF targets only")
