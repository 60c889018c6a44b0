"""decode.engine.length: chain lengths chosen by measured forward costs and acceptance."""

from specdec.decode.engine.length import DraftLength


def _costs(length: DraftLength, per_token: float) -> None:
    for w in (1, 2, 4, 8, 13):
        for _ in range(5):
            length.record_forward(1, w, 0.05 * (1 + per_token * (w - 1)))


def _accept(length: DraftLength, cls: int, rate_first: float, rounds: int = 400) -> None:
    """Rows whose first draft is accepted ``rate_first`` of the time, later ones always after that."""
    for i in range(rounds):
        a = 12 if (i % 100) < rate_first * 100 else 0
        length.observe([cls], [12], [a])


def test_costly_verification_and_poor_acceptance_draft_little():
    length = DraftLength(12)
    _costs(length, per_token=0.25)
    _accept(length, cls=1, rate_first=0.2)
    assert max(length.best(1, 1, 12) for _ in range(20)) <= 3  # one at most, and exploration's two more
    cheap = DraftLength(12)
    _costs(cheap, per_token=0.01)
    _accept(cheap, cls=1, rate_first=0.8)
    assert min(cheap.best(1, 1, 12) for _ in range(20)) == 12


def test_classes_are_kept_apart_and_unknown_costs_draft_everything():
    length = DraftLength(8)
    assert length.best(0, 1, 8) == 8  # nothing measured yet: the drafter's own length
    _costs(length, per_token=0.15)
    _accept(length, cls=3, rate_first=0.95)
    _accept(length, cls=1, rate_first=0.05)
    long = min(length.best(3, 1, 8) for _ in range(20))
    short = max(length.best(1, 1, 8) for _ in range(20))
    assert long >= 6 and short <= 2
    assert length.best(3, 1, 2) <= 2  # never past what the row has
    assert length.forward_cost(1, 20) > length.forward_cost(1, 13)  # extrapolated by the last slope
