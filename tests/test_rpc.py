"""llama.cpp's RPC backend with pykvq caches: the layers and their KV cache on two ggml-rpc-server workers.

The workers are pykvq's build/bin/ggml-rpc-server on loopback ports (a second machine works the same way,
see README). A run with `--rpc a,b -ngl 99` must equal the local run: same greedy tokens, KLD ~ 0, for stock and
pykvq types, file codebooks, converted files and pre-RoPE / centred key caches (the worker says in HELLO which
key domains its backend runs; native/include/ggml-kvq-rpc.h).
"""
from __future__ import annotations

import re
import socket
import struct
import threading
import time

import pytest
from conftest import run_tool

from pykvq.serve import RpcWorkers, Server

PROMPT = "The three largest cities of France are"


@pytest.fixture(scope="module")
def workers():
    """Two pykvq RPC workers on free loopback ports, one CPU thread each; stopped after the module."""
    with RpcWorkers(2, threads=1) as w:
        yield w.endpoints


def complete(model, *args, rpc: str | None = None, env: dict | None = None):
    extra = ["--rpc", rpc, "-ngl", "99"] if rpc else ["-ngl", "0"]
    res = run_tool("llama-completion", "-m", model, "-p", PROMPT, "-n", "24", "--temp", "0", "-no-cnv",
                   "-fa", "on", "-c", "512", "-t", "2", "-lv", "4", *extra, *args, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, res.stderr


@pytest.mark.parametrize("cache", ["f16", "q4_0", "nuq4", "bfp4_32", "file", "ksorted"])
def test_rpc_greedy_equals_local(smollm2, smollm2_codebooks, smollm2_converted, workers, cache):
    """"file": per-layer types and codebooks from the GGUF; "ksorted": a converted file (K-sort with its 2-D rope
    factors, smoothing, Hadamard V; its own bfp4_32 cache types)."""
    model, args = {"file": (smollm2_codebooks, []), "ksorted": (smollm2_converted, [])}.get(
        cache, (smollm2, ["-ctk", cache, "-ctv", cache]))
    local, _ = complete(model, *args)
    remote, log = complete(model, *args, rpc=workers)
    assert remote == local and len(local) > len(PROMPT) + 20
    # the layers and their KV cache really live on the workers
    assert len(set(re.findall(r"- (RPC\d) \(127\.0\.0\.1:\d+\) \|", log))) == 2, log[-3000:]   # both workers hold layers
    assert "offloaded 31/31 layers" in log
    if cache == "file":
        assert "codebooks: file for 29 layers" in log, log[-3000:]
    if cache == "ksorted":
        assert "keys are K-sorted" in log and "bfp4_32" in log, log[-3000:]


@pytest.mark.parametrize("domain,window", [("pre", []), ("pre", ["--kv-window", "0", "--kv-sinks", "0"]),
                                           ("centred", [])])
def test_prerope_cache_runs_over_rpc(smollm2_prerope, workers, domain, window):
    """A pre-RoPE (or centred) key cache on two CPU workers: they said in HELLO that their backend has the
    kernels, so the layers and their caches go there, and the answer is the local one."""
    env = {"PYKVQ_K_DOMAIN": domain}
    local, _ = complete(smollm2_prerope, "-ctk", "q4_0", "-ctv", "q4_0", *window, env=env)
    remote, log = complete(smollm2_prerope, "-ctk", "q4_0", "-ctv", "q4_0", *window, "-v", rpc=workers,
                           env={**env, "GGML_SCHED_DEBUG": "1"})      # -v: the scheduler's splits and their inputs
    assert remote == local and len(local) > len(PROMPT) + 20
    assert len(set(re.findall(r"- (RPC\d) \(127\.0\.0\.1:\d+\) \|", log))) == 2, log[-3000:]
    assert "offloaded 31/31 layers" in log
    assert ("pre-RoPE" if domain == "pre" else "centred") in log, log[-3000:]
    # the positions and rotary frequencies attention reads are host inputs the scheduler copies into each worker's
    # split (llama_kvq_fa_inputs_to_graph), not tensors in the worker's compute memory that later nodes reuse: there
    # the host's write of the next batch's raced the GPU still running the last one (CUDA, 2026-11-27). The window's
    # own nodes happened to make them leafs; without a window (or centred) nothing else did.
    inputs = " ".join(re.findall(r"## SPLIT #\d+: RPC\d[^\n]*", log))
    assert "[kvq_k_pos" in inputs and "[kvq_rope_freqs-0" in inputs, inputs[:2000]


@pytest.mark.parametrize("kt,vt", [("q53_64", "q4_0"), ("q42_64", "nuq3")])
def test_keys_in_halves_run_over_rpc(smollm2_prerope, workers, kt, vt):
    """Keys split in halves (q53_64 / q42_64: the Hadamard without its stride-32 butterfly on a 128 head, 32 wide on
    SmolLM2's 64) on two CPU workers: the layers and their caches go there and the answer is the local one."""
    local, _ = complete(smollm2_prerope, "-ctk", kt, "-ctv", vt)
    remote, log = complete(smollm2_prerope, "-ctk", kt, "-ctv", vt, rpc=workers)
    assert remote == local and len(local) > len(PROMPT) + 20
    assert len(set(re.findall(r"- (RPC\d) \(127\.0\.0\.1:\d+\) \|", log))) == 2, log[-3000:]
    assert "offloaded 31/31 layers" in log and kt in log, log[-3000:]


class _CapsProxy:
    """A loopback proxy in front of a real pykvq worker that rewrites the HELLO answer's padding byte to
    `mark` and forwards everything else: a worker whose backend lacks the pre-RoPE kernels (no such backend is
    built here). HELLO is the first command of every connection."""

    def __init__(self, target: str, mark: int):
        host, port = target.rsplit(":", 1)
        self.target, self.mark = (host, int(port)), mark
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.endpoint = "127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def _recv(conn, n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return buf

    @staticmethod
    def _pipe(a, b):
        try:
            while chunk := a.recv(1 << 16):
                b.sendall(chunk)
        except OSError:
            pass
        finally:
            try:   # shutdown, not close alone: it wakes the other direction's recv and the worker sees EOF
                b.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            b.close()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            worker = socket.create_connection(self.target)
            try:
                req = self._recv(client, 9)
                req += self._recv(client, struct.unpack("<Q", req[1:9])[0])
                worker.sendall(req)
                size = self._recv(worker, 8)
                rsp = bytearray(self._recv(worker, struct.unpack("<Q", size)[0]))
                rsp[3] = self.mark
                client.sendall(size + rsp)
            except (ConnectionError, OSError):
                client.close(), worker.close()
                continue
            threading.Thread(target=self._pipe, args=(client, worker), daemon=True).start()
            threading.Thread(target=self._pipe, args=(worker, client), daemon=True).start()

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("domain,mark", [("pre", 0x82), ("centred", 0x92)])
def test_prerope_cache_is_refused_on_worker_without_kernels(smollm2_prerope, workers, domain, mark):
    """A pykvq worker whose HELLO says its backend has no kernels for this key domain (0x82: none; 0x92:
    pre-RoPE only, as a CUDA worker said before it had centred kernels) gets no pre-RoPE / centred cache: a clear
    refusal before anything runs."""
    proxy = _CapsProxy(workers.split(",")[0], mark)
    try:
        res = run_tool("llama-completion", "-m", smollm2_prerope, "-p", PROMPT, "-n", "4", "--temp", "0", "-no-cnv",
                       "-fa", "on", "-c", "512", "-t", "2", "-ctk", "q4_0", "-ctv", "q4_0", "--rpc", proxy.endpoint,
                       "-ngl", "99", env={"PYKVQ_K_DOMAIN": domain}, timeout=300)
    finally:
        proxy.close()
    assert res.returncode != 0
    want = ("the pre-RoPE key cache has kernels for CPU and CUDA only, not for this RPC worker's backend"
            if domain == "pre" else "the centred key cache (--kv-domain centred) has kernels for CPU and CUDA only, not for this RPC")
    assert want in res.stderr, res.stderr[-3000:]
    assert "-nkvo" in res.stderr


def test_window_is_off_on_a_worker_that_does_not_read_it(smollm2_prerope, workers):
    """A pykvq worker whose HELLO has the pre-RoPE and centred bits but not the window's (0xb2: an older pykvq
    worker, or a backend without the kernel) runs the pre-RoPE cache without the window, and the log says so: its
    greedy answer is the local one without a window."""
    proxy = _CapsProxy(workers.split(",")[0], 0x82 | 0x10 | 0x20)
    try:
        remote, log = complete(smollm2_prerope, "-ctk", "q4_0", "-ctv", "q4_0", "--kv-window", "64", "--kv-sinks", "4",
                               rpc=proxy.endpoint)
    finally:
        proxy.close()
    assert "exact window off: no quantized pre-RoPE layer is on a device whose kernels read it" in log, log[-3000:]
    local, _ = complete(smollm2_prerope, "-ctk", "q4_0", "-ctv", "q4_0", "--kv-window", "0", "--kv-sinks", "0")
    assert remote == local


def test_hello_mark_of_this_build_says_cpu_runs_both_domains(workers):
    """The real worker's HELLO byte: pykvq, layout 2, pre-RoPE and centred kernels and the window (its backend is the
    CPU)."""
    host, port = workers.split(",")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn:
        req = bytes(24)
        conn.sendall(bytes([14]) + struct.pack("<Q", len(req)) + req)
        size = struct.unpack("<Q", _CapsProxy._recv(conn, 8))[0]
        rsp = _CapsProxy._recv(conn, size)
    assert rsp[3] == 0x82 | 0x10 | 0x20 | 0x40, hex(rsp[3])


@pytest.mark.parametrize("case", ["nuq4", "prerope-q4_0", "prerope-q4_0-window"])
def test_rpc_perplexity_kld_is_zero(smollm2, smollm2_prerope, passage, workers, tmp_path, case):
    """KLD of the RPC run against the local run: ~0 (the same kernels run on the workers' CPU), with the exact window
    too (the workers said in HELLO that they read it)."""
    text = tmp_path / "passage.txt"
    text.write_text(passage)
    base = tmp_path / "local.kld"
    model, ct = (smollm2, "nuq4") if case == "nuq4" else (smollm2_prerope, "q4_0")
    # the window in one ubatch of 512: each query reads its own window rows, the batch's stage rows included (results
    # can depend on the thread count where a kernel splits its work by it, so the local run takes the workers' one)
    win = ["--kv-sinks", "4", "--kv-window", "64"] if case.endswith("window") else []
    common = ["-m", model, "-f", text, "-c", "512", "--chunks", "2", "-b", "512", "-ctk", ct, "-ctv", ct,
              "-fa", "on", "-t", "1" if win else "2", "-lv", "4", *win]
    res = run_tool("llama-perplexity", *common, "-ngl", "0", "--kl-divergence-base", base, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_tool("llama-perplexity", *common, "--rpc", workers, "-ngl", "99", "--kl-divergence-base", base,
                   "--kl-divergence", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert case == "nuq4" or "pre-RoPE key cache in 30 of 30 layers" in res.stderr, res.stderr[-3000:]
    assert not win or "exact window in 30 of 30 layers" in res.stderr, res.stderr[-3000:]
    m = re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", res.stdout + res.stderr)
    assert m, (res.stdout + res.stderr)[-3000:]     # no KLD printed: say what the tool did print
    assert abs(float(m.group(1))) < 1e-4, m.group(1)


def test_rpc_server_answers_like_local(smollm2, workers, tmp_path):
    body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0.0}
    with Server(smollm2, cache_type_k="nuq4", cache_type_v="nuq4", n_ctx=512, threads=2,
                log_path=tmp_path / "local.log") as srv:
        local = srv.post("/completion", body)["content"]
    with Server(smollm2, cache_type_k="nuq4", cache_type_v="nuq4", n_ctx=512, threads=2,
                extra=["--rpc", workers, "-ngl", "99"], log_path=tmp_path / "rpc.log") as srv:
        remote = srv.post("/completion", body)["content"]
    assert remote == local and local.strip()


def _stock_worker(sock: socket.socket) -> None:
    """Answers HELLO exactly as upstream's ggml-rpc-server does (protocol 7.0.0, padding byte 0), then closes:
    a stand-in for a worker built without pykvq (building a second llama.cpp here would take minutes)."""
    conn, _ = sock.accept()
    with conn:
        cmd = conn.recv(1)
        size = struct.unpack("<Q", conn.recv(8))[0]
        while size > 0:
            size -= len(conn.recv(size))
        assert cmd == bytes([14])                              # RPC_CMD_HELLO
        rsp = bytes([7, 0, 0, 0]) + bytes(24)                  # major, minor, patch, padding, conn_caps[24]
        conn.sendall(struct.pack("<Q", len(rsp)) + rsp)
        time.sleep(0.5)


def test_worker_without_pykvq_is_refused(smollm2):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    t = threading.Thread(target=_stock_worker, args=(sock,), daemon=True)
    t.start()
    try:
        res = run_tool("llama-completion", "-m", smollm2, "-p", "x", "-n", "1", "-no-cnv", "--rpc",
                       f"127.0.0.1:{port}", "-ngl", "99", timeout=120)
    finally:
        t.join(timeout=10)
        sock.close()
    assert res.returncode != 0
    assert "built without pykvq" in res.stderr, res.stderr[-2000:]
