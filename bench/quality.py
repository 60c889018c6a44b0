"""Quality on checkable tasks, for methods whose output may differ from the target's own (approximate
modes, diffusion strategies): a record with an ``answer`` is a task the completion is scored on.

- list tasks (``examples/list_tasks.jsonl``): the completion's first line equals the answer;
- code tasks (``"task": "code"``, ``examples/code_tasks.jsonl``): the prompt is a function's signature
  and docstring, the answer its held-out body. The completion's body is its lines up to the first one
  that is not indented (the function ended); scored by exact match with the answer (trailing spaces and
  blank lines aside) and by whether the prompt and that body parse as Python (``ast.parse``).
"""

from __future__ import annotations

import ast


def first_line_matches(completion: str, answer: str) -> bool:
    """Exact match of the completion's first line, ignoring surrounding whitespace."""
    lines = completion.strip().splitlines()
    return bool(lines) and lines[0].strip() == answer.strip()


def function_body(completion: str) -> str:
    """The completion's lines up to the first non-blank one that starts at column 0."""
    kept = []
    for line in completion.splitlines():
        if line.strip() and not line[:1].isspace():
            break
        kept.append(line)
    return "\n".join(kept)


def _normal(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def score(prompt: str, completion: str, record: dict) -> dict | None:
    """The completion's scores on the record's task; None for a record without an ``answer``."""
    answer = record.get("answer")
    if answer is None:
        return None
    if record.get("task") == "code":
        body = function_body(completion)
        try:
            ast.parse(prompt + body + "\n")
            parses = True
        except SyntaxError:
            parses = False
        return {"code_exact": _normal(body) == _normal(answer), "code_parses": parses}
    return {"list_exact": first_line_matches(completion, answer)}


def summarise(scores: list[dict | None]) -> dict:
    """Each score's mean over the records that have it (``list_exact``, ``code_exact``, ``code_parses``)."""
    out: dict = {}
    for name in ("list_exact", "code_exact", "code_parses"):
        values = [s[name] for s in scores if s and name in s]
        if values:
            out[name] = round(sum(values) / len(values), 4)
    return out
