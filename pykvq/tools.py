"""The patched llama.cpp tools beside the library pykvq loads: pykvq/lib/ in an installed wheel, build/bin/ in a
clone. `pykvq tool llama-cli -m M.gguf -ctk q53_64 ...` runs one with its arguments unchanged."""
from __future__ import annotations

import os
from pathlib import Path

from ._lib import lib_path
from .errors import PykvqError

# the tools a wheel carries (setup.py's TOOLS; a clone's build/bin has them too)
TOOLS = ("llama-cli", "llama-completion", "llama-perplexity", "llama-bench", "llama-server", "ggml-rpc-server")


def tool_path(name: str) -> Path:
    """The built tool `name`; an unknown or unbuilt one raises PykvqError saying which ones there are."""
    if name not in TOOLS:
        raise PykvqError(f"unknown tool '{name}'; pykvq carries: {', '.join(TOOLS)}")
    p = lib_path().parent / name
    if not p.is_file():
        raise PykvqError(f"{p} is not built; run 'make build' in a clone, or reinstall with 'pip install .'")
    return p


def exec_tool(name: str, args: list[str]) -> None:
    """Replace this process with the tool (signals, exit status and the terminal go straight to it)."""
    p = tool_path(name)
    os.execv(p, [str(p), *args])
