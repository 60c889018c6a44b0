"""``--drafter auto``, decode's default: the fastest lossless method measured for the target's family
(its ``fastest.json``, when the drafter it names ships), ``ngram`` otherwise, ``ar`` where the other
options take plain decoding; the job says which, and the text is plain decoding's."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

from conftest import invoke

from specdec.models.artifacts import SHIPPED_DIR, WINNER_FILE

ROOT = Path(__file__).resolve().parent.parent


def _decode(tmp_path, target, *flags):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(x):\n    return x + x\n" * 2}) + "\n" for i in range(3)))
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
    res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(target), "--max-new-tokens", "12", *flags])
    assert res.exit_code == 0, res.output
    return res.output, [(r["completion"], r["stats"]) for r in map(json.loads, out.read_text().splitlines())]


def test_auto_is_ngram_for_a_target_no_family_holds(tmp_path, tiny_family):
    said, auto = _decode(tmp_path, tiny_family / "target")
    assert "drafter: ngram (auto:" in said
    _, plain = _decode(tmp_path, tiny_family / "target", "--drafter", "ar")
    assert [c for c, _ in auto] == [c for c, _ in plain]
    assert sum(s["drafted_tokens"] for _, s in auto) > 0 and sum(s["drafted_tokens"] for _, s in plain) == 0


def test_auto_takes_the_family_winner_when_it_ships(tmp_path, tiny_family, monkeypatch):
    home = tmp_path / "home"
    family = home / "tiny-stdlib"
    family.mkdir(parents=True)
    shutil.copytree(tiny_family / "target", family / "target")
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    (family / WINNER_FILE).write_text(json.dumps({"method": "draft", "summary": "measured here"}))
    work = tmp_path / "work"
    work.mkdir()
    said, _ = _decode(work, "tiny-stdlib")
    assert "drafter: ngram (auto:" in said  # the winner does not ship here: no silent failure, the fallback
    shutil.copytree(tiny_family / "draft", family / "draft")
    said, auto = _decode(work, "tiny-stdlib")
    assert "drafter: tiny-stdlib/draft (auto: the fastest lossless method measured for tiny-stdlib (measured here))" in said
    _, plain = _decode(work, "tiny-stdlib", "--drafter", "ar")
    assert [c for c, _ in auto] == [c for c, _ in plain]


def test_a_winner_measured_with_options_brings_them_where_it_was_measured(tmp_path, tiny_family, monkeypatch):
    """``trimmed+lookup=ngram`` in ``fastest.json``: auto decodes with the trimmed drafter and n-gram lookup under
    the conditions it was measured at, and ``ngram`` elsewhere, saying why."""
    home = tmp_path / "home"
    family = home / "tiny-stdlib"
    family.mkdir(parents=True)
    shutil.copytree(tiny_family / "target", family / "target")
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    winner = {"method": "trimmed+lookup=ngram", "summary": "measured here", "when": {"batch_size": 8, "temperature": 0.0}}
    (family / WINNER_FILE).write_text(json.dumps(winner))
    work = tmp_path / "work"
    work.mkdir()
    from specdec.decode.drafters import trimmed

    built = []
    real = trimmed.build_trimmed
    monkeypatch.setattr(trimmed, "build_trimmed", lambda *a: built.append(a[-1]) or real(*a))
    said, auto = _decode(work, "tiny-stdlib")
    assert "drafter: trimmed+lookup=ngram (auto: the fastest lossless method measured for tiny-stdlib" in said
    assert type(built[-1]).__name__ == "NgramDrafter"
    _, plain = _decode(work, "tiny-stdlib", "--drafter", "ar")
    assert [c for c, _ in auto] == [c for c, _ in plain]
    # measured at batch 8, greedy: at another batch size or temperature, auto is ngram and says why
    said, _ = _decode(work, "tiny-stdlib", "--batch-size", "2")
    assert "drafter: ngram (auto: trimmed+lookup=ngram is the fastest measured for tiny-stdlib at batch_size 8, " \
           "temperature 0.0, not at batch_size 2)" in said


def test_auto_follows_the_otherwise_rule_whose_conditions_hold(tmp_path, tiny_family, monkeypatch):
    """Where the winner was not measured, the first ``otherwise`` rule whose conditions hold decides (plain
    decoding where no drafter paid at that batch size); where none holds, ``ngram``."""
    home = tmp_path / "home"
    family = home / "tiny-stdlib"
    family.mkdir(parents=True)
    shutil.copytree(tiny_family / "target", family / "target")
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    winner = {"method": "trimmed+lookup=ngram", "summary": "measured here", "when": {"batch_size": 1, "temperature": 0.0},
              "otherwise": [{"method": "draft", "summary": "not shipped", "when": {"batch_size": 3}},  # skipped: absent
                            {"method": "ar", "summary": "nothing paid", "when": {"batch_size": 3, "temperature": 0.0}}]}
    (family / WINNER_FILE).write_text(json.dumps(winner))
    work = tmp_path / "work"
    work.mkdir()
    said, out = _decode(work, "tiny-stdlib", "--batch-size", "3")
    assert "drafter: ar (auto: the fastest lossless method measured for tiny-stdlib at batch_size 3, temperature 0.0 " \
           "(nothing paid))" in said
    assert all(s.get("drafted_tokens", 0) == 0 for _, s in out)
    said, _ = _decode(work, "tiny-stdlib", "--batch-size", "3", "--temperature", "0.5")
    assert "drafter: ngram (auto: trimmed+lookup=ngram is the fastest measured" in said
    shutil.copytree(tiny_family / "draft", family / "draft")
    said, _ = _decode(work, "tiny-stdlib", "--batch-size", "3")
    assert "drafter: tiny-stdlib/draft (auto: the fastest lossless method measured for tiny-stdlib at batch_size 3 " \
           "(not shipped))" in said


def test_the_users_own_options_win_over_the_winners(monkeypatch):
    from specdec.decode.jobs.validate import resolve_auto
    from specdec.decode.options import DecodeOptions
    from specdec.models import artifacts

    winner = {"family": "f", "method": "trimmed+lookup=ngram+k=5", "summary": "s", "when": {}}
    monkeypatch.setattr(artifacts, "family_winner", lambda source: winner)
    chosen, _, said = resolve_auto("f", DecodeOptions())
    assert (chosen.drafting.drafter, chosen.drafting.lookup, chosen.drafting.num_draft) == ("trimmed", "ngram", 5)
    chosen, _, said = resolve_auto("f", DecodeOptions(num_draft=3))
    assert (chosen.drafting.drafter, chosen.drafting.lookup, chosen.drafting.num_draft) == ("trimmed", "ngram", 3)
    assert said.startswith("drafter: trimmed+lookup=ngram+k=5 (auto:")


def test_auto_takes_plain_decoding_where_the_options_need_it(tmp_path, tiny_family):
    said, out = _decode(tmp_path, tiny_family / "target", "--beams", "2")
    assert "drafter: ar (auto: the other options take plain decoding)" in said
    assert all(s.get("drafted_tokens", 0) == 0 for _, s in out)


def test_the_default_family_winner_is_its_report_fastest_lossless_method():
    """The shipped ``fastest.json`` names the fastest lossless specdec method of the report it cites, so
    the default follows a measurement, and a drafter that ships must beat it there to take its place."""
    info = json.loads((SHIPPED_DIR / "gemma3-270m" / WINNER_FILE).read_text())
    report = json.loads((ROOT / info["report"]).read_text())
    doc = runpy.run_path(str(ROOT / "scripts" / "benchmarks-doc"), run_name="benchmarks_doc")
    best = doc["headline"](Path(info["report"]).stem, report)
    assert best["method"] == info["method"], (best, info)
    # the conditions it is the winner under are the report's own
    assert info["when"] and info["when"] == {k: report["config"][k] for k in info["when"]}
    # and so for each rule of other conditions: the fastest of its own report, under that report's conditions
    for rule in info.get("otherwise", []):
        report = json.loads((ROOT / rule["report"]).read_text())
        assert doc["headline"](Path(rule["report"]).stem, report)["method"] == rule["method"], rule
        assert rule["when"] and rule["when"] == {k: report["config"][k] for k in rule["when"]}
