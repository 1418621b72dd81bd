"""The process policy of ``meshd run`` (``meshd/daemon.py``)."""

from __future__ import annotations

import gc

from meshd.daemon import settle_heap


def test_settle_heap_takes_what_the_process_holds_out_of_full_collections() -> None:
    """What a node holds once it serves stays, so a full collection need not walk it: it is
    frozen, and a full collection then walks only what was made after."""
    held = [[i] for i in range(1000)]  # containers the collector tracks, like a loaded process's
    assert gc.is_tracked(held[0])
    try:
        frozen = settle_heap()
        assert frozen == gc.get_freeze_count() >= len(held)
        assert not any(obj is held[0] for obj in gc.get_objects())
        later = [held[0]]
        assert any(obj is later for obj in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(obj is held[0] for obj in gc.get_objects())
