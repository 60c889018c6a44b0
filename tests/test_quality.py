"""bench.quality: the checkable tasks' scores, and the shipped code tasks scoring their own answers."""

from __future__ import annotations

import json

from specdec.bench import quality
from specdec.examples import example_path


def test_a_function_body_ends_where_the_next_top_level_line_starts():
    completion = "    x = 1\n\n    return x\ndef other():\n    pass\n"
    assert quality.function_body(completion) == "    x = 1\n\n    return x"


def test_code_scores_exact_match_and_parsing():
    rec = {"task": "code", "answer": "    return a + b\n"}
    prompt = "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"
    assert quality.score(prompt, "    return a + b  \n\nprint(1)\n", rec) == {"code_exact": True, "code_parses": True}
    assert quality.score(prompt, "    return a - b\n", rec) == {"code_exact": False, "code_parses": True}
    assert quality.score(prompt, "    return (a +\n", rec) == {"code_exact": False, "code_parses": False}
    assert quality.score(prompt, "anything", {}) is None


def test_list_tasks_score_the_first_line():
    assert quality.score("p", " b a\nmore", {"answer": "b a"}) == {"list_exact": True}
    assert quality.score("p", " a b\n", {"answer": "b a"}) == {"list_exact": False}
    assert quality.summarise([{"list_exact": True}, None, {"list_exact": False}, {"code_exact": True, "code_parses": True}]) == {
        "list_exact": 0.5, "code_exact": 1.0, "code_parses": 1.0}


def test_every_shipped_code_task_scores_its_own_answer_as_right():
    tasks = [json.loads(line) for line in example_path("code_tasks.jsonl").read_text().splitlines()]
    assert len(tasks) >= 20
    for t in tasks:
        assert quality.score(t["prompt"], t["answer"] + "\ndef next_function():\n    pass\n", t) == {"code_exact": True, "code_parses": True}
        assert quality.score(t["prompt"], "    return (\n", t)["code_exact"] is False
