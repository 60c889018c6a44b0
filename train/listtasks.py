"""Deterministic list tasks (copy / reverse / sort short lists of words) with exact-match answers.

ParallelBench's lesson: parallel decoding fails first where output tokens depend on each other,
and list manipulation exposes that offline. The same generator feeds the dLLM training mix and
the held-out quality probes; ``split`` keeps the two disjoint by hashing each task.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

WORDS = (
    "apple", "bird", "cloud", "door", "eagle", "fish", "grape", "house", "iron", "jam",
    "kite", "lemon", "moon", "nest", "olive", "pear", "queen", "river", "stone", "tree",
    "umbrella", "violin", "water", "yarn", "zebra", "anna", "ben", "carl", "dora", "emma",
    "finn", "gina", "hugo", "ivy", "jack", "kim", "leo", "mia", "nina", "otto",
)  # fmt: skip
OPERATIONS = ("copy", "reverse", "sort")
HELDOUT_EVERY = 10  # one task in ten (by hash) is held out


@dataclass(frozen=True)
class ListTask:
    op: str
    items: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return f"{self.op}: {' '.join(self.items)}\nanswer:"

    @property
    def answer(self) -> str:
        return " ".join(apply_op(self.op, self.items))

    @property
    def completion(self) -> str:
        return f" {self.answer}\n"

    def record(self, index: int) -> dict:
        return {"id": f"list-{self.op}-{index}", "prompt": self.prompt, "answer": self.answer, "category": f"list-{self.op}"}


def apply_op(op: str, items: tuple[str, ...]) -> list[str]:
    if op == "copy":
        return list(items)
    if op == "reverse":
        return list(reversed(items))
    if op == "sort":
        return sorted(items)
    raise ValueError(f"unknown list operation {op!r}")


def _is_heldout(task: ListTask) -> bool:
    digest = hashlib.sha256(f"{task.op}|{' '.join(task.items)}".encode()).digest()
    return digest[0] % HELDOUT_EVERY == 0


def list_tasks(n: int, seed: int = 0, split: str = "train", min_len: int = 3, max_len: int = 6, ops=OPERATIONS) -> list[ListTask]:
    """``n`` tasks, the same for the same arguments; ``split`` is ``train`` or ``heldout`` (disjoint)."""
    if split not in ("train", "heldout"):
        raise ValueError("split must be 'train' or 'heldout'")
    rng = random.Random(f"{seed}-{split}")
    tasks: list[ListTask] = []
    while len(tasks) < n:
        task = ListTask(rng.choice(ops), tuple(rng.sample(WORDS, rng.randint(min_len, max_len))))
        if _is_heldout(task) == (split == "heldout"):
            tasks.append(task)
    return tasks
