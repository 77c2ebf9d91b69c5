"""Resumable result files: {"meta": {...}, "rows": {key: row}} written atomically after every row.

A file is reused only when its meta "config" (what the rows depend on: text,
chunking, model file) equals the run's; otherwise it is set aside as
<name>.stale.json and the run starts afresh, so mixed configurations never
end up in one table.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class ResultStore:
    def __init__(self, path: str | os.PathLike, config: dict):
        self.path = Path(path)
        self.config = config
        self.meta: dict = {"config": config}
        self.rows: dict[str, dict] = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = None
            if data and data.get("meta", {}).get("config") == config:
                self.meta, self.rows = data["meta"], data["rows"]
            else:
                self.path.replace(self.path.with_suffix(".stale.json"))

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def put(self, key: str, row: dict) -> None:
        self.rows[key] = row
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))
        tmp.replace(self.path)


def load(path: str | os.PathLike) -> dict | None:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None
