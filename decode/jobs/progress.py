"""The one progress bar: a decode job's records and a trainer's steps, on stderr through rich."""

from __future__ import annotations


class ProgressBar:
    """One line on stderr: ``label``, a bar, the count (done / total, or the ``count`` template over the
    task's fields, e.g. ``"step {task.fields[step]}"``), the elapsed time and a status text. With
    ``enabled`` False every call does nothing. ``console``: the rich console to draw on (default: a
    new one on stderr). ``total`` None: the bar has no end (a count of what is done so far)."""

    def __init__(self, label: str, total: float | None, *, enabled: bool = True, console=None, completed: float = 0,
                 count: str | None = None, status: str = "", **fields):
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn(label), BarColumn(), TextColumn(count) if count else MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=console or Console(stderr=True), transient=False,
        )
        self.task = self.bar.add_task(label, total=total, completed=completed, status=status, **fields)

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self.enabled:
            self.bar.__exit__(*exc)
        return False

    def update(self, *, completed: float | None = None, advance: float | None = None, status: str | None = None, **fields) -> None:
        if not self.enabled:
            return
        if status is not None:
            fields["status"] = status
        self.bar.update(self.task, completed=completed, advance=advance, **fields)
