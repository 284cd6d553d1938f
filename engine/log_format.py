"""One log line format for every process (the server, the engine core, the workers): vLLM's shape,
level and time first, so a slow start-up or a stall can be read off the log.

    INFO 11-26 18:07:37.412 [trio_llm.serve] engine ready in 2.1 s
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: int | str) -> None:
    """The root logger's console handler, at `level`, with timestamps (a no-op once configured)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=DATE_FORMAT)
