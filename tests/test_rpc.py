"""llama.cpp's RPC backend with pykvq caches: the layers and their KV cache on two ggml-rpc-server workers.

The workers are pykvq's build/bin/ggml-rpc-server on loopback ports (a second machine works the same way,
see README). A run with `--rpc a,b -ngl 99` must equal the local run: same greedy tokens, KLD ~ 0.
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


def complete(model, *args, rpc: str | None = None):
    extra = ["--rpc", rpc, "-ngl", "99"] if rpc else ["-ngl", "0"]
    res = run_tool("llama-completion", "-m", model, "-p", PROMPT, "-n", "24", "--temp", "0", "-no-cnv",
                   "-fa", "on", "-c", "512", "-t", "2", "-lv", "4", *extra, *args, timeout=300)
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


def test_prerope_cache_is_refused_over_rpc(smollm2_prerope, workers):
    """A pre-RoPE key cache has GPU kernels for CUDA only; the client cannot know an RPC worker's backend,
    so offloading one there is refused before anything runs, naming the ways out."""
    res = run_tool("llama-completion", "-m", smollm2_prerope, "-p", PROMPT, "-n", "4", "--temp", "0", "-no-cnv",
                   "-fa", "on", "-c", "512", "-t", "2", "-ctk", "q4_0", "-ctv", "q4_0", "--rpc", workers, "-ngl", "99",
                   timeout=300)
    assert res.returncode != 0
    assert "GPU kernels for CUDA only, not for RPC" in res.stderr, res.stderr[-3000:]
    assert "PYKVQ_K_DOMAIN=post" in res.stderr and "-nkvo" in res.stderr


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
