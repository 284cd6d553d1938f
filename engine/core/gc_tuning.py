"""The cyclic garbage collector, tuned for a long-lived serving process."""

from __future__ import annotations

import gc

# Collector thresholds for a serving process (Python's defaults: 700, 10, 10).
SERVER_GC_THRESHOLDS = (20_000, 50, 100)


def tune_collector_for_serving() -> None:
    """Tune this process's cyclic garbage collector for serving, once the engine is up.

    Process-wide, so only the process entry points call it (`serve`, `app_from_env`,
    the engine process), never the app factory. Everything alive now (modules, the model, the tokenizer)
    lives as long as the server: `gc.freeze()` moves it out of the collector's sight.
    Measured (docs/decisions.md): full collections walking it paused the loop for up
    to 134 ms under load; after the freeze the loop-lag p99 fell from <= 250 ms to
    <= 25 ms and /v1/embeddings gained ~12%. Requests' objects are freed by reference
    counting; with the default thresholds the collector, run every 700 net
    allocations, cost ~110 us per /v1/embeddings request; with these almost none.
    """
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
