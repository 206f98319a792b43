"""The server freezes its start-up heap: a full GC collection then skips it (no 100+ ms pauses)."""

import gc

from ferrylm.server.state import freeze_startup_heap


def test_freeze_startup_heap_moves_live_objects_out_of_collections():
    keep = [{"i": i} for i in range(1000)]  # alive at "start-up"
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(keep)
        assert not any(obj is keep for obj in gc.get_objects())  # a full collection no longer walks them
    finally:
        gc.unfreeze()
