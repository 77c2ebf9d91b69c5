"""llama.cpp's RPC backend with pykvq caches: the layers and their KV cache on two ggml-rpc-server workers.

The workers are pykvq's build/bin/ggml-rpc-server on loopback ports (a second machine works the same way,
see README). A run with `--rpc a,b -ngl 99` must equal the local run: same greedy tokens, KLD ~ 0.
"""
from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import run_tool, tool
from gguf_variants import variant

from pykvq.serve import Server, free_port

N_LAYER = 30
PROMPT = "The three largest cities of France are"


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"ggml-rpc-server did not listen on {port}")


@pytest.fixture(scope="module")
def workers():
    """Two pykvq RPC workers on free loopback ports, one CPU thread each; stopped after the module."""
    procs, ports = [], []
    try:
        for _ in range(2):
            port = free_port()
            p = subprocess.Popen([str(tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            _wait_port(port, p)
            ports.append(port)
        yield ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def codebook_file(smollm2, tmp_path_factory):
    cb = np.array([-120, -80, -45, -15, 15, 45, 80, 120], np.int8)
    return variant(smollm2, tmp_path_factory.mktemp("rpc") / "codebooks.gguf",
                   layer_types_k=["q8_0"] + ["nuq3"] * (N_LAYER - 1), layer_types_v=["q8_0"] * N_LAYER,
                   type_k="nuq3", type_v="q8_0", rot_k=True, codebooks_k={il: cb for il in range(1, N_LAYER)})


def complete(model, *args, rpc: str | None = None):
    extra = ["--rpc", rpc, "-ngl", "99"] if rpc else ["-ngl", "0"]
    res = run_tool("llama-completion", "-m", model, "-p", PROMPT, "-n", "24", "--temp", "0", "-no-cnv",
                   "-fa", "on", "-c", "512", "-t", "2", "-lv", "4", *extra, *args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, res.stderr


@pytest.mark.parametrize("cache", ["f16", "q4_0", "nuq4", "bfp4_32", "file", "ksorted"])
def test_rpc_greedy_equals_local(smollm2, codebook_file, smollm2_converted, workers, cache):
    """"file": per-layer types and codebooks from the GGUF; "ksorted": a converted file (K-sort with its 2-D rope
    factors, smoothing, Hadamard V; its own bfp4_32 cache types)."""
    model, args = {"file": (codebook_file, []), "ksorted": (smollm2_converted, [])}.get(
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


def test_rpc_perplexity_kld_is_zero(smollm2, passage, workers, tmp_path):
    text = tmp_path / "passage.txt"
    text.write_text(passage)
    base = tmp_path / "local.kld"
    common = ["-m", smollm2, "-f", text, "-c", "512", "--chunks", "2", "-b", "512", "-ctk", "nuq4", "-ctv", "nuq4",
              "-fa", "on", "-t", "2"]
    res = run_tool("llama-perplexity", *common, "-ngl", "0", "--kl-divergence-base", base, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_tool("llama-perplexity", *common, "--rpc", workers, "-ngl", "99", "--kl-divergence-base", base,
                   "--kl-divergence", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    kld = float(re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", res.stdout + res.stderr).group(1))
    assert abs(kld) < 1e-4, kld


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
