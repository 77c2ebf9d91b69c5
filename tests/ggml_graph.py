"""A small ggml graph harness for op-level tests on the CPU backend (through pykvq's cffi binding)."""
from __future__ import annotations

import functools

import cffi
import numpy as np

import native_decls  # noqa: F401
from pykvq import cache_types
from pykvq._lib import ffi, lib

# the CPU backend object (its use_ref mode is test-backend-ops' reference), which pykvq's binding does not declare
_bffi = cffi.FFI()
_bffi.cdef("""
    void * ggml_backend_cpu_init(void);
    void   ggml_backend_cpu_set_n_threads(void * backend, int n_threads);
    void   ggml_backend_cpu_set_use_ref(void * backend, bool use_ref);
    int    ggml_backend_graph_compute(void * backend, void * cgraph);
    void   ggml_backend_free(void * backend);
""")


@functools.cache
def _backend_libs():
    d = lib().path.parent
    return _bffi.dlopen(str(d / "libggml-base.so")), _bffi.dlopen(str(d / "libggml-cpu.so"))


class Graph:
    """A ggml context with a few helpers; tensors are filled from / read into numpy."""

    def __init__(self, mem: int = 64 << 20):
        self.L = lib()
        p = ffi.new("struct ggml_init_params *", {"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": False})
        self.ctx = self.L.ggml_init(p[0])
        self.gf = self.L.ggml_new_graph(self.ctx)

    def tensor(self, type_name: str, *ne, data: np.ndarray | None = None):
        tid = cache_types.CACHE_TYPES.get(type_name, {"i64": 27, "i32": 26}.get(type_name))
        t = getattr(self.L, f"ggml_new_tensor_{len(ne)}d")(self.ctx, tid, *ne)
        if data is not None:
            b = np.ascontiguousarray(data).tobytes()
            assert len(b) == self.L.ggml_nbytes(t)
            ffi.memmove(self.L.ggml_get_data(t), b, len(b))
        return t

    def raw(self, t) -> bytes:
        return bytes(ffi.buffer(self.L.ggml_get_data(t), self.L.ggml_nbytes(t)))

    def f32(self, t) -> np.ndarray:
        return np.frombuffer(self.raw(t), np.float32).copy()

    def compute(self, *outs, n_threads: int = 2):
        for o in outs:
            self.L.ggml_build_forward_expand(self.gf, o)
        assert self.L.ggml_graph_compute_with_ctx(self.ctx, self.gf, n_threads) == 0

    def compute_cpu_backend(self, *outs, n_threads: int = 2, use_ref: bool = False, reps: int = 1):
        """The graph on a CPU backend object; use_ref: its reference mode, as test-backend-ops runs it.
        reps: computed that many times; the backend keeps one work buffer, where compute() takes a new one
        from the context on every call (a benchmark's loop of compute() runs the context out of memory)."""
        for o in outs:
            self.L.ggml_build_forward_expand(self.gf, o)
        base, cpu = _backend_libs()
        be = cpu.ggml_backend_cpu_init()
        try:
            cpu.ggml_backend_cpu_set_n_threads(be, n_threads)
            cpu.ggml_backend_cpu_set_use_ref(be, use_ref)
            gf = _bffi.cast("void *", int(ffi.cast("uintptr_t", self.gf)))
            for _ in range(reps):
                assert base.ggml_backend_graph_compute(be, gf) == 0
        finally:
            base.ggml_backend_free(be)

    def close(self):
        self.L.ggml_free(self.ctx)
