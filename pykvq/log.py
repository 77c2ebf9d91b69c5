"""Route llama.cpp / ggml log output through Python.

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
_callback = None  # the cffi callback must stay referenced while the lib is loaded


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


def install(lib) -> None:
    global _callback
    from ._lib import ffi

    @ffi.callback("void(int, const char *, void *)")
    def _on_log(level, text, _user):
        s = ffi.string(text).decode("utf-8", "replace")
        _buffer.append(s)
        if _verbose or level == _LEVEL_ERROR:
            sys.stderr.write(s)

    _callback = _on_log
    lib.llama_log_set(_callback, ffi.NULL)
