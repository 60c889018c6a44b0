"""Recipes load, held-out prompts are well formed, and (slow) the real recipe builds at a tiny budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import invoke

from specdec.recipes import list_recipes, recipe_path
from specdec.train.corpus import stdlib_corpus
from specdec.train.recipe import RecipeConfig


def test_every_recipe_yaml_loads():
    assert "tiny-stdlib" in list_recipes()
    for name in list_recipes():
        path = recipe_path(name)
        assert path.read_text().lstrip().startswith("#"), f"{name}: the header must show the command"
        if name in ("tiny-stdlib", "pycode"):
            cfg = RecipeConfig.load(path)
            assert cfg.budget_minutes <= 20 and abs(sum(cfg.shares.values()) - 1.0) < 0.1


def test_unknown_recipe_keys_are_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbudget_minute: 3\n")
    with pytest.raises(Exception, match="unknown recipe keys"):
        RecipeConfig.load(bad)


def test_heldout_split_is_fixed_and_disjoint():
    a, b = stdlib_corpus(0.03), stdlib_corpus(0.03)
    assert a.heldout_files == b.heldout_files and a.heldout_files
    assert not set(a.heldout_files) & set(a.train_files)


def test_shipped_prompts_come_from_heldout_files():
    rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(__file__), "..", "examples", "prompts.jsonl"))]
    corpus = stdlib_corpus(0.03)
    heldout = {str(p.relative_to(corpus.root)) for p in corpus.heldout_files}
    assert {r["category"] for r in rows} == {"code", "docstring", "data"}
    for r in rows:
        assert r["source"].rsplit(":", 1)[0] in heldout
        assert r["prompt"] and r["id"]


def test_dev_prompts_keep_away_from_the_benchmark_prompts(tmp_path):
    """train-acceptance's policy prompts: the benchmark's kinds, from held-out files, never within the
    distance of a benchmark prompt's anchor, at most two a file."""
    from types import SimpleNamespace

    from specdec.train.prompts import dev_prompts

    def source(n_funcs):
        return "".join(f"\n\ndef f{i}(x):\n    y = x + {i}\n    return y * 2\n    # a comment line\n" for i in range(n_funcs))

    files = {tmp_path / "a.py": source(60), tmp_path / "b.py": source(60), tmp_path / "c.py": source(3)}
    for path, text in files.items():
        path.write_text(text)
    corpus = SimpleNamespace(root=tmp_path, heldout_files=list(files), read=lambda p: files[p])
    tok = lambda text: {"input_ids": text.split()}  # noqa: E731 (a word tokenizer is enough here)
    bench = [{"source": "a.py:3"}, {"source": "a.py:123"}, {"source": "b.py:63"}]
    dev = dev_prompts(corpus, tok, bench, per_category=5, distance=40, lo=8, hi=40)
    assert dev and {d["category"] for d in dev} == {"code"} and len(dev) <= 5
    taken = {(b["source"].split(":")[0], int(b["source"].split(":")[1])) for b in bench}
    per_file = {}
    for d in dev:
        name, line = d["source"].rsplit(":", 1)
        assert all(abs(int(line) - b) >= 40 for f, b in taken if f == name)
        assert lines_of(files[tmp_path / name], int(line)).startswith("def ") and d["prompt"] in files[tmp_path / name]
        per_file[name] = per_file.get(name, 0) + 1
    assert max(per_file.values()) <= 2 and len(per_file) >= 2


def lines_of(text: str, line: int) -> str:
    return text.splitlines()[line - 1]


def test_list_task_probes_are_held_out_and_match_the_shipped_file(tmp_path):
    from specdec.train.listtasks import list_tasks
    from specdec.train.recipe import write_list_task_probes

    rows = [json.loads(line) for line in write_list_task_probes(tmp_path / "l.jsonl").read_text().splitlines()]
    shipped = os.path.join(os.path.dirname(__file__), "..", "examples", "list_tasks.jsonl")
    assert rows == [json.loads(line) for line in open(shipped)]  # examples/list_tasks.jsonl is what the recipe writes
    train = {t.prompt for t in list_tasks(3000, seed=0)}
    assert len(rows) == 48 and all(r["answer"] and r["prompt"] not in train for r in rows)


def test_recipe_list_command():
    res = invoke(["recipe", "list"])
    assert res.exit_code == 0 and "tiny-stdlib" in res.output


@pytest.mark.slow
def test_tiny_budget_recipe_end_to_end(tmp_path):
    """The real recipe at a 2-minute budget, then decode two held-out prompts with it."""
    env = {**os.environ, "SPECDEC_HOME": str(tmp_path / "home")}
    build = subprocess.run([sys.executable, "-m", "specdec", "recipe", "run", "tiny-stdlib", "--budget-minutes", "2"],
                           capture_output=True, text=True, env=env, timeout=1200)
    assert build.returncode == 0, build.stderr[-3000:]
    fam = tmp_path / "home" / "tiny-stdlib"
    metrics = json.loads((fam / "target" / "metrics.json").read_text())
    assert metrics["tokens_trained"] > 0 and metrics["heldout_loss"] < 8.3  # below uniform over 4096 tokens
    assert len((fam / "list_tasks.jsonl").read_text().splitlines()) == 48
    # the dLLM went through masked CE and then certainty forcing; its filter was fitted on code prompts
    dllm_cfg = json.loads((fam / "dllm" / "config.json").read_text())
    assert dllm_cfg["specdec_kind"] == "dllm" and dllm_cfg["dllm_training"] == ["masked_ce", "certainty_forcing"]
    assert json.loads((fam / "dllm" / "metrics.json").read_text())["self_generated"] > 0
    assert (fam / "filter" / "metrics.json").exists()
    # the acceptance artifact's greedy policy was chosen on the dev prompts, which keep away from the bench's
    dev = [json.loads(line) for line in (fam / "dev_prompts.jsonl").read_text().splitlines()]
    bench = {json.loads(line)["prompt"] for line in (fam / "prompts.jsonl").read_text().splitlines()}
    assert dev and not {d["prompt"] for d in dev} & bench
    onpolicy = json.loads((fam / "acceptance" / "metrics.json").read_text())["policy_simulation"]["greedy"]["onpolicy"]
    assert onpolicy["prompts_from"] == str(fam / "dev_prompts.jsonl") and onpolicy["prompts"] == min(len(dev), 24)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line for line in open(fam / "prompts.jsonl").readlines()[:2]))
    for drafter in ["ar", "ngram"]:
        out = tmp_path / f"{drafter}.jsonl"
        dec = subprocess.run([sys.executable, "-m", "specdec", "decode", "--in", str(src), "--out", str(out),
                              "--drafter", drafter, "--max-new-tokens", "16"], capture_output=True, text=True, env=env, timeout=600)
        assert dec.returncode == 0, dec.stderr[-3000:]
    ar = [json.loads(line)["completion"] for line in open(tmp_path / "ar.jsonl")]
    ng = [json.loads(line)["completion"] for line in open(tmp_path / "ngram.jsonl")]
    assert ar == ng and len(ar) == 2


def test_pretrained_prompts_hold_every_kind_in_turn(tmp_path, monkeypatch):
    """The default family's benchmark prompts: code kinds and prose in turn, so `bench --limit N` takes each."""
    from conftest import save_tiny_lm, tiny_tokenizer

    from specdec.train import recipe

    save_tiny_lm(tmp_path / "target", tiny_tokenizer(), seed=0)
    code = [{"id": f"{k}-{i}", "category": k, "prompt": "x"} for i in range(3) for k in ("docstring", "data", "code")]
    monkeypatch.setattr(recipe, "held_out_prompts", lambda corpus, tok, per_category: code)
    out = recipe.write_pretrained_prompts(None, ["a b c", "d e f"], tmp_path / "target", tmp_path / "p.jsonl", 3)
    cats = [json.loads(line)["category"] for line in out.read_text().splitlines()]
    assert cats == ["docstring", "data", "code", "prose"] * 2 + ["docstring", "data", "code"]
