"""Read a GGUF into memory-mapped tensors and write one back atomically.

Tensors keep their storage type: a block-quantized tensor is a uint8 array of
shape [rows, bytes per row] (rows = output channels), a float tensor is a
numpy array in its own dtype, both with rows first (ggml's ne reversed).
Metadata is copied field by field with gguf-py's writer; only the keys the
converter sets are changed.
"""
from __future__ import annotations

import mmap
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
    fast = _read_fast(path)
    if fast is not None:
        return GGUFModel(*fast, path)
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


# ---- a fast reader for the common case -----------------------------------------------------------
# gguf-py's reader makes a numpy view per value: a 50k-150k token vocabulary takes it 5-15 s. This one reads the
# same little-endian v2/v3 files with plain bytes (0.1-0.3 s) and gives up (None) on anything else - another byte
# order, a nested array, a repeated key or name, a value out of bounds - so that gguf-py reads those (and words the
# error) exactly as before. tests/test_convert.py holds the two readers equal on real files.
_SCALARS = {VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4", VT.INT32: "<i4",
            VT.FLOAT32: "<f4", VT.BOOL: "?", VT.UINT64: "<u8", VT.INT64: "<i8", VT.FLOAT64: "<f8"}
_TENSOR_DTYPES = {QT.F16: np.float16, QT.F32: np.float32, QT.F64: np.float64, QT.I8: np.int8, QT.I16: np.int16,
                  QT.I32: np.int32, QT.I64: np.int64}
INT_TYPES = (QT.I8, QT.I16, QT.I32, QT.I64)   # integer tensors (nuq codebooks): values, not weights to decode


class _Bad(Exception):
    pass


def _read_fast(path: Path) -> tuple[dict[str, Field], dict[str, Tensor]] | None:
    try:
        data = np.memmap(path, mode="r")
    except (OSError, ValueError):
        return None
    buf = memoryview(data)
    pos = 0

    def take(n: int) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            raise _Bad
        pos += n
        return buf[pos - n:pos]

    def u32() -> int:
        return int.from_bytes(take(4), "little")

    def u64() -> int:
        return int.from_bytes(take(8), "little")

    def string() -> str:
        return str(take(u64()), "utf-8")

    def scalar(vt: VT):
        dt = np.dtype(_SCALARS[vt])
        return np.frombuffer(take(dt.itemsize), dt)[0].item()

    try:
        if bytes(take(4)) != b"GGUF" or u32() not in (2, 3):
            return None
        n_tensors, n_kv = u64(), u64()
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            return None
        fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = string()
            vt = VT(u32())
            sub = None
            if vt == VT.STRING:
                value = string()
            elif vt == VT.ARRAY:
                sub, n = VT(u32()), u64()
                if sub == VT.STRING:
                    value = [string() for _ in range(n)]
                elif sub in _SCALARS:
                    dt = np.dtype(_SCALARS[sub])
                    value = np.frombuffer(take(n * dt.itemsize), dt).tolist()
                else:
                    return None
            else:
                value = scalar(vt)
            if key in fields or key.startswith("GGUF."):
                return None
            fields[key] = Field(key, value, vt, sub)
        infos = []
        for _ in range(n_tensors):
            name = string()
            n_dims = u32()
            if n_dims > 8:
                return None
            dims = [u64() for _ in range(n_dims)]
            infos.append((name, dims, QT(u32()), u64()))
        align = fields.get("general.alignment")
        alignment = 32 if align is None else align.value
        if align is not None and (align.vtype != VT.UINT32 or alignment == 0 or alignment & (alignment - 1)):
            return None
        start = -(-pos // alignment) * alignment
        tensors: dict[str, Tensor] = {}
        for name, dims, qt, offset in infos:
            n_elems = 1
            for d in dims:
                n_elems *= d
            block, type_size = gguf.GGML_QUANT_SIZES[qt]     # float and integer types: (1, itemsize)
            n_bytes = n_elems * type_size // block
            shape = tuple(reversed(dims))
            dtype = _TENSOR_DTYPES.get(qt)
            if dtype is None:
                if not shape or shape[-1] % block:
                    return None
                dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size)
            begin = start + offset
            if name in tensors or begin + n_bytes > len(data):
                return None
            tensors[name] = Tensor(name, qt, data[begin:begin + n_bytes].view(dtype).reshape(shape))
        return fields, tensors
    except (_Bad, ValueError, UnicodeDecodeError, KeyError):
        return None


def _release_pages(a: np.ndarray) -> None:
    """Once a tensor of a memory-mapped input is written, drop its pages from this process: pages of a file mapping
    that were read count in the resident memory until the mapping goes (Qwen2.5-Coder-1.5B: the whole 1.1 GB input
    by the end of the write). The data stays in the page cache; a later read maps it back."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    mm = getattr(root, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or a.nbytes == 0:
        return
    # numpy maps from the offset rounded down to the allocation granularity; the array starts past that remainder
    start = (a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
             + int(getattr(root, "offset", 0)) % mmap.ALLOCATIONGRANULARITY)
    page = mmap.PAGESIZE
    first = start // page * page
    try:
        mm.madvise(mmap.MADV_DONTNEED, first, start + a.nbytes - first)
    except (OSError, ValueError):        # not this mapping's range after all: keep the pages
        pass


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
            _release_pages(t.data)
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
