"""Progress bars for long evaluations and conversions (tqdm, on stderr).

enable=None shows a bar only when stderr is a terminal; True/False force it.
"""
from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def progress_bar(it: Iterable[T], desc: str = "", enable: bool | None = None, total: int | None = None,
                 unit: str = "it") -> Iterable[T]:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; stay usable without it
        return it
    return tqdm(it, desc=desc, disable=None if enable is None else not enable, total=total,
                unit=unit, leave=False, dynamic_ncols=True)
