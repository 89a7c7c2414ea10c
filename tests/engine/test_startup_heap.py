"""The start-up heap frozen for the garbage collector: garbage collected first, the rest skipped
by later full collections, newer objects still collected."""

from __future__ import annotations

import json
import subprocess
import sys

# Run in a process of its own: freezing is process-wide. Builds a garbage cycle (must be
# collected, not frozen), 50,000 live containers (must be frozen: a full collection no longer
# visits them), then, after the freeze, a new garbage cycle (must still be collected).
PROGRAM = """
import gc, json, weakref
from kvpilot.engine.startup_heap import freeze_startup_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

old_garbage = cycle()
live = [[i] for i in range(50_000)]
tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
tracked_after = len(gc.get_objects())
new_garbage = cycle()
collected = gc.collect()
print(json.dumps({
    "old_garbage_gone": old_garbage() is None,
    "frozen": frozen,
    "freeze_count": gc.get_freeze_count(),
    "tracked_before": tracked_before,
    "tracked_after": tracked_after,
    "new_garbage_gone": new_garbage() is None,
    "collected": collected,
    "live_intact": sum(x[0] for x in live) == sum(range(50_000)),
}))
"""


def test_freeze_startup_heap_skips_the_startup_objects_and_still_collects_new_garbage():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["old_garbage_gone"]
    assert result["frozen"] == result["freeze_count"] >= 50_000
    # Frozen objects leave the generations a collection walks.
    assert result["tracked_before"] >= 50_000
    assert result["tracked_after"] < result["tracked_before"] - 50_000
    assert result["new_garbage_gone"]
    assert result["collected"] >= 2  # the two nodes of the new cycle (and their dicts)
    assert result["live_intact"]
