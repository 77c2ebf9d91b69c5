"""llama-server with pykvq's cache types: the command line, and a managed server process.

    pykvq serve                                   # SmolLM2, the GGUF's cache types (else f16), port 8080
    pykvq serve -m model.gguf -ctk nuq4 -ctv nuq4 -np 4 -c 8192 -- --slot-save-path /tmp/slots

    with Server(model, cache_type_k="nuq4", cache_type_v="nuq4") as srv:
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none").chat.completions.create(...)

A converted GGUF carries its cache types (pykvq.cache.type_k/v, per-layer types, codebooks): leaving the
types open lets llama-server take them from the file, exactly as llama-cli does.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .cache_types import resolve
from .errors import PykvqError
from .tools import tool_path


def server_binary() -> Path:
    """llama-server next to the patched library."""
    return tool_path("llama-server")


def server_command(model: str | os.PathLike, *, cache_type_k: str | None = None, cache_type_v: str | None = None,
                   host: str = "127.0.0.1", port: int = 8080, n_parallel: int = 1, n_ctx: int | None = None,
                   threads: int | None = None, k_domain: str | None = None, encoder: str | None = None,
                   extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The llama-server command line: flash attention on (quantized V needs it), the given cache types or
    the file's, n_ctx shared by n_parallel slots; k_domain / encoder as llama-server's --kv-domain / --kv-encoder."""
    for t in (cache_type_k, cache_type_v):
        if t is not None:
            resolve(t)                      # an unknown name fails here, with the list of known ones
    cmd = [str(server_binary()), "-m", str(model), "--host", host, "--port", str(port),
           "-np", str(n_parallel), "-fa", "on", "--no-webui"]
    if n_ctx:
        cmd += ["-c", str(n_ctx)]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    if cache_type_k:
        cmd += ["-ctk", cache_type_k]
    if cache_type_v:
        cmd += ["-ctv", cache_type_v]
    if k_domain:
        cmd += ["--kv-domain", k_domain]
    if encoder:
        cmd += ["--kv-encoder", encoder]
    return cmd + list(extra)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """A llama-server process on a loopback port, stopped on exit (also when the body raises)."""

    def __init__(self, model: str | os.PathLike, *, port: int | None = None, log_path: str | os.PathLike | None = None,
                 startup_timeout: float = 180.0, **kwargs):
        self.host = kwargs.pop("host", "127.0.0.1")
        self.port = port or free_port(self.host)
        self.cmd = server_command(model, host=self.host, port=self.port, **kwargs)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Server":
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PykvqError(f"llama-server exited with {self.proc.returncode} while starting: {self.log_tail()}")
            try:
                if self.get("/health").get("status") == "ok":
                    return self
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(0.25)
        self.stop()
        raise PykvqError(f"llama-server did not become ready in {self.startup_timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path and self.log_path.is_file():
            return self.log_path.read_text(errors="replace")[-n:]
        return "(no log: pass log_path)"

    # plain JSON over HTTP, for the endpoints the OpenAI client does not cover (/health, /slots, /props)
    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")

    def get(self, path: str, timeout: float = 5.0) -> dict:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 300.0) -> dict:
        return self.request("POST", path, body, timeout=timeout)


class RpcWorkers:
    """n of pykvq's ggml-rpc-server workers on free loopback ports, stopped on exit. `endpoints` is the value for
    the tools' --rpc (llama-bench: -rpc)."""

    def __init__(self, n: int = 2, *, threads: int = 1, host: str = "127.0.0.1", startup_timeout: float = 60.0):
        self.n, self.threads, self.host, self.startup_timeout = n, threads, host, startup_timeout
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.host}:{p}" for p in self.ports)

    def start(self) -> "RpcWorkers":
        binary = tool_path("ggml-rpc-server")
        try:
            for _ in range(self.n):
                port = free_port(self.host)
                proc = subprocess.Popen([str(binary), "-H", self.host, "-p", str(port), "-t", str(self.threads)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                self.procs.append(proc)
                self._wait(port, proc)
                self.ports.append(port)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, port: int, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PykvqError(f"ggml-rpc-server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with socket.create_connection((self.host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise PykvqError(f"ggml-rpc-server did not listen on {self.host}:{port}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs, self.ports = [], []

    def __enter__(self) -> "RpcWorkers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model, **kwargs) -> int:
    """Run llama-server in the foreground (Ctrl-C stops it); returns its exit code."""
    cmd = server_command(model, **kwargs)
    print("pykvq serve:", " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0
