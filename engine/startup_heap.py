"""The heap a process builds at start-up, moved out of the cyclic garbage collector's way.

Loading a model leaves ~320,000 container objects that live as long as the process (modules,
the tokenizer, configs, imported libraries). CPython's collector walks every one of them in
each full (generation-2) collection: ~145 ms on one core for the engine of the default model,
during which no step runs and no token is streamed. Such a collection comes when enough newer
objects have survived (a server's requests and their outputs), so under load it lands in the
middle of decoding, as a step 1.5x-2.5x the usual length. ``gc.freeze()`` moves every object
alive at that moment to a permanent generation that collections skip (CPython's advice for
pre-fork servers; vLLM freezes its engine core's and API server's start-up heaps likewise),
after ``gc.collect()`` has removed what was garbage already. Objects created later are collected
as before; a start-up object that becomes part of a garbage cycle later is not (its memory stays
until the process ends), which is why only what was built to live for the whole process is
frozen, once, when it is ready.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect garbage, then freeze every object alive now (``gc.freeze``). Returns how many
    objects are frozen in all (``gc.get_freeze_count()``). Never raises. Call it once the
    process's long-lived state is built: after the engine (or the server's engine client) is
    loaded, before the first request."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug(
        "froze %d start-up objects for the garbage collector (%.0f ms)",
        frozen,
        1000 * (time.perf_counter() - start),
    )
    return frozen
