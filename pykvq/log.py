"""llama.cpp / ggml log output, routed through Python (pure: pykvq/_lib.py installs the callback).

Lines are kept in a ring buffer (so errors can quote what llama.cpp said) and
echoed to stderr when verbose logging is on (PYKVQ_VERBOSE=1 or
set_verbose(True)). Records of pykvq's own go to the 'pykvq' logger.
"""
from __future__ import annotations

import collections
import logging
import os
import sys

logger = logging.getLogger("pykvq")

_LEVEL_ERROR = 4
_KEEP = 5000  # fragments; context creation alone logs a few hundred at debug level
_buffer: collections.deque[str] = collections.deque(maxlen=_KEEP)
_verbose = os.environ.get("PYKVQ_VERBOSE", "") not in ("", "0")


def set_verbose(on: bool) -> None:
    global _verbose
    _verbose = bool(on)


def recent(n: int = _KEEP) -> list[str]:
    """The last n log fragments llama.cpp emitted in this process."""
    return list(_buffer)[-n:]


def clear() -> None:
    _buffer.clear()


def recent_text(n: int = 20) -> str:
    return "".join(recent(n)).strip()


def record(level: int, text: str) -> None:
    """One fragment of llama.cpp's log (ggml_log_level level): kept, and echoed when verbose or an error."""
    _buffer.append(text)
    if _verbose or level == _LEVEL_ERROR:
        sys.stderr.write(text)
