"""Stop strings over a stream of text pieces (pure): what generate(stop=...) yields.

A piece is held back while its end could still be the start of a stop string, so a streamed reply
never shows text a later piece turns into a stop; the reply ends before the first stop string.
"""
from __future__ import annotations

from typing import Iterable, Iterator


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def until_stop(pieces: Iterable[str], stops: Iterable[str] | None) -> Iterator[str]:
    """The pieces up to (not including) the first occurrence of any stop string."""
    stops = tuple(s for s in (stops or ()) if s)
    if not stops:
        yield from pieces
        return
    buf = ""
    for piece in pieces:
        buf += piece
        hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if hits:
            if min(hits) > 0:
                yield buf[:min(hits)]
            return
        keep = _held_back(buf, stops)
        if len(buf) > keep:
            yield buf[:len(buf) - keep]
            buf = buf[len(buf) - keep:]
    if buf:
        yield buf
