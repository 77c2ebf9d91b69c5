"""Read a GGUF into memory-mapped tensors and write one back atomically.

Tensors keep their storage type: a block-quantized tensor is a uint8 array of
shape [rows, bytes per row] (rows = output channels), a float tensor is a
numpy array in its own dtype, both with rows first (ggml's ne reversed).
Metadata is copied field by field with gguf-py's writer; only the keys the
converter sets are changed.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT


class ConvertError(Exception):
    """The input cannot be converted as asked; the message says why."""


@dataclass
class Tensor:
    name: str
    qtype: QT
    data: np.ndarray          # float array [rows, cols] or uint8 [rows, row bytes]

    @property
    def quantized(self) -> bool:
        return self.qtype not in (QT.F32, QT.F16, QT.BF16)

    @property
    def n_rows(self) -> int:
        return self.data.shape[0] if self.data.ndim > 1 else 1


@dataclass
class Field:
    name: str
    value: Any
    vtype: VT
    sub_type: VT | None = None


class GGUFModel:
    """A GGUF's metadata fields and tensors, in file order."""

    def __init__(self, fields: dict[str, Field], tensors: dict[str, Tensor], path: Path | None = None):
        self.fields = fields
        self.tensors = tensors
        self.path = path

    @property
    def arch(self) -> str:
        return str(self.meta("general.architecture"))

    def meta(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.value

    def arch_meta(self, key: str, default: Any = None) -> Any:
        return self.meta(f"{self.arch}.{key}", default)

    def set(self, key: str, value: Any, vtype: VT, sub_type: VT | None = None) -> None:
        self.fields[key] = Field(key, value, vtype, sub_type)

    def layer_count(self) -> int:
        return int(self.arch_meta("block_count"))


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError / struct errors on damaged files
        raise ConvertError(f"{path} is not a readable GGUF file: {e}") from e
    fields = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == VT.ARRAY else None
        fields[f.name] = Field(f.name, f.contents(), vtype, sub)
    tensors = {}
    for t in reader.tensors:
        tensors[t.name] = Tensor(t.name, QT(t.tensor_type), t.data)
    return GGUFModel(fields, tensors, path)


def write_gguf(model: GGUFModel, out: str | os.PathLike, *,
               progress: Callable[[int], None] | None = None) -> None:
    """Write model to out through a temporary file in the same directory, then
    rename it into place: a failure never leaves a half-written out."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, model.arch)
        for f in model.fields.values():
            if f.name == gguf.Keys.General.ARCHITECTURE:
                continue
            w.add_key_value(f.name, f.value, f.vtype, sub_type=f.sub_type)
        for t in model.tensors.values():
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in model.tensors.values():
            w.write_tensor_data(np.ascontiguousarray(t.data))
            if progress:
                progress(t.data.nbytes)
        w.close()
        os.replace(tmp, out)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):      # a full disk, a file-size limit, a read-only directory
            kept = "left as it was" if out.exists() else "not written"
            why = e.strerror or f"{e}: the disk is full or a file-size limit was reached"   # numpy's short write
            raise ConvertError(f"cannot write {out}: {why} ({out.name} {kept}, the input untouched)") from e
        raise
