"""Intra-op threads that follow the cores this process can have now (``--threads 0``, the default).

Every torch operation splits its work over the OpenMP threads and waits at a barrier for the last one.
When another process keeps a core busy, the thread placed on that core runs only when the scheduler
gives it a slice, and every operation waits for it: on a 2-core machine with one core busy, Gemma 3
270M decoded at 2.5-4.6 tokens/s with two threads and 10.3 with one (10.1 with two under
``OMP_WAIT_POLICY=PASSIVE``, which costs 17% on a quiet machine: 14.6 against 17.6). So the thread
count follows the load: the cores this process may run on, less the share of them that other
processes used over the last interval (read from ``/proc/stat``, this process's own time from
``/proc/self/stat`` taken out), re-read every ``PERIOD_S`` seconds between decode rounds. Where those
files do not exist, the count stays at the ceiling. ``--threads N`` fixes the count instead.
"""

from __future__ import annotations

import contextlib
import os
import time

PERIOD_S = 2.0
# a core counts as free when others used less than this much of it: a core that is 40% busy elsewhere
# still stalls every operation's barrier for as long as a scheduler slice
FREE_BELOW = 0.25


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_busy(cpus: list[int]) -> float | None:
    """Busy clock ticks of ``cpus`` since boot (steal included: time the hypervisor gave elsewhere)."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    total = 0
    seen = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        v = [int(x) for x in rest.split()]
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        total += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
        seen += 1
    return float(total) if seen else None


def _own_ticks() -> float | None:
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return float(int(fields[11]) + int(fields[12]))  # utime, stime of every thread of this process


class Governor:
    """The process's intra-op thread count, kept at most ``ceiling`` and at most the free cores."""

    def __init__(self, ceiling: int, period_s: float = PERIOD_S):
        import torch

        self.torch = torch
        self.ceiling = max(1, ceiling)
        self.period_s = period_s
        self.cpus = allowed_cpus()
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()
        self.current = self.ceiling
        torch.set_num_threads(self.current)
        self.history: list[tuple[float, int]] = []  # (busy elsewhere, threads) at each decision

    def _sample(self):
        busy, own = _cpu_busy(self.cpus), _own_ticks()
        return None if busy is None or own is None else (time.monotonic(), busy, own)

    def busy_elsewhere(self) -> float | None:
        """Cores' worth of work other processes did since the last reading (and a new reading starts)."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] - last[0] <= 0:
            return None
        ticks = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, ticks / self.hz / (now[0] - last[0]))

    def tick(self) -> int:
        """Between rounds: re-read the load once ``period_s`` has passed and set the threads it allows."""
        if self._last is None or time.monotonic() - self._last[0] < self.period_s:
            return self.current
        other = self.busy_elsewhere()
        if other is None:
            return self.current
        free = len(self.cpus) - int(other + 1 - FREE_BELOW)
        threads = max(1, min(self.ceiling, free))
        self.history.append((round(other, 2), threads))
        del self.history[:-64]
        if threads != self.current:
            self.current = threads
            self.torch.set_num_threads(threads)
        return threads


_governor: Governor | None = None
_torch_default: int | None = None  # torch's own count, as a plain transformers user gets it


def torch_default() -> int:
    """The intra-op thread count torch starts with (before specdec set any)."""
    global _torch_default
    if _torch_default is None:
        import torch

        _torch_default = torch.get_num_threads()
    return _torch_default


def follow_load(ceiling: int) -> Governor:
    """From now on the thread count follows the load under ``ceiling`` (what ``tick`` sets)."""
    global _governor
    torch_default()
    _governor = Governor(ceiling)
    return _governor


def fix(threads: int) -> None:
    """A fixed count (``--threads N``, or a trainer's): the load is no longer followed."""
    global _governor
    import torch

    torch_default()
    _governor = None
    torch.set_num_threads(threads)


@contextlib.contextmanager
def held(threads: int):
    """``threads`` fixed inside the block (a bench method's ``+threads=N``), and after it what was there
    before: the governor that followed the load, or the fixed count."""
    global _governor
    import torch

    saved, before = _governor, torch.get_num_threads()
    fix(threads)
    try:
        yield
    finally:
        _governor = saved
        torch.set_num_threads(saved.current if saved is not None else before)


def tick() -> int | None:
    """Called between decode rounds; the count now, or None when it is fixed."""
    return _governor.tick() if _governor is not None else None


def governor() -> Governor | None:
    return _governor
