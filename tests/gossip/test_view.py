"""The peer-sampling view: bounded, freshest entry wins, stale entries age out."""

from __future__ import annotations

from murmura.gossip import PeerView
from murmura.protocols import PeerInfo


def test_view_never_exceeds_its_size_and_keeps_the_freshest() -> None:
    view = PeerView("me", 4)
    view.merge([PeerInfo(f"p{i}", f"h:{i}", 0, age=i) for i in range(10)])

    assert len(view) == 4
    assert view.ids() == ["p0", "p1", "p2", "p3"]


def test_view_ignores_its_owner_and_prefers_a_fresher_entry() -> None:
    view = PeerView("me", 8)
    view.merge([PeerInfo("me", "h:0"), PeerInfo("a", "h:1", age=5)])
    view.merge([PeerInfo("a", "h:9", age=1)])

    assert "me" not in view
    assert view.get("a") == PeerInfo("a", "h:9", 0, 1)


def test_entries_nobody_refreshes_age_out() -> None:
    view = PeerView("me", 2, max_age=3)
    view.merge([PeerInfo("a", "h:1")])
    for _ in range(3):
        view.tick()
    assert "a" in view
    view.tick()
    assert "a" not in view
