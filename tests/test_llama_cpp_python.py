"""llama-cpp-python (its pure-Python layer, pinned 0.3.36) on pykvq's patched library.

llama.h must stay upstream's byte for byte: llama-cpp-python's ctypes structs mirror it, and a single
extra field makes llama_context_default_params() write past the caller's buffer. pykvq's settings go
through native/include/llama-kvq-api.h instead.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest

from conftest import REPO

TREE = REPO / "third_party" / "llama.cpp"

# llama_cpp is only ever imported in child processes: importing it installs llama-cpp-python's own log callback
# into the shared libllama, which would take llama.cpp's messages away from this process's pykvq models.
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python's Python layer is installed by 'make setup'", allow_module_level=True)


def _child(code: str, *args: str) -> str:
    """Run code in a fresh interpreter that points llama_cpp at pykvq's library first (as a user's script would)."""
    res = subprocess.run([sys.executable, "-c", "import pykvq\npykvq.use_with_llama_cpp()\n" + textwrap.dedent(code), *args],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _sdist_llama_h() -> bytes:
    sys.path.insert(0, str(REPO / "third_party"))
    import fetch
    with tarfile.open(fetch.sdist_path(fetch.read_pin())) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("vendor/llama.cpp/include/llama.h"))
        return tf.extractfile(member).read()


def test_llama_h_is_upstreams():
    assert (TREE / "include" / "llama.h").read_bytes() == _sdist_llama_h(), \
        "a patch changed llama.h: pykvq's settings belong in native/include/llama-kvq-api.h"


STRUCTS = ["llama_context_params", "llama_model_params", "llama_batch", "llama_token_data",
           "llama_token_data_array", "llama_model_quantize_params", "llama_chat_message",
           "llama_sampler_chain_params", "llama_logit_bias"]


def _ctypes_layout() -> dict:
    """sizeof and every field's offset of the structs above, as llama-cpp-python's ctypes declares them."""
    return json.loads(_child("""
        import ctypes, json, sys
        import llama_cpp
        out = {}
        for name in sys.argv[1:]:
            cls = getattr(llama_cpp.llama_cpp, name)
            out[name] = {"(sizeof)": ctypes.sizeof(cls), **{f[0]: getattr(cls, f[0]).offset for f in cls._fields_}}
        print(json.dumps(out))
    """, *STRUCTS))


def _c_layout(tmp_path, fields: dict) -> dict:
    """sizeof and every field's offset of the structs above, as the patched tree's C compiler sees them."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lines = []
    for name in STRUCTS:
        lines.append(f'printf("\\"{name}\\": {{\\"(sizeof)\\": %zu", sizeof(struct {name}));')
        for field in fields[name]:
            if field == "(sizeof)":
                continue
            lines.append(f'printf(", \\"{field}\\": %zu", offsetof(struct {name}, {field}));')
        lines.append('printf("}%s\\n", "' + ("," if name != STRUCTS[-1] else "") + '");')
    src = tmp_path / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"llama.h\"\nint main(void) {\n"
                   "printf(\"{\\n\");\n" + "\n".join(lines) + "\nprintf(\"}\\n\");\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(TREE / "include"), "-I", str(TREE / "ggml" / "include"),
                    str(src), "-o", str(exe)], check=True, capture_output=True)
    return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


def test_struct_layouts_match_llama_cpp_python(tmp_path):
    from pykvq._lib import ffi
    py = _ctypes_layout()
    c = _c_layout(tmp_path, py)
    for name in STRUCTS:
        assert py[name] == c[name], name
    # pykvq's own cffi declarations agree too
    assert ffi.sizeof("struct llama_context_params") == c["llama_context_params"]["(sizeof)"]
    assert ffi.sizeof("struct llama_model_params") == c["llama_model_params"]["(sizeof)"]


def test_ggml_type_ids_exported():
    import pykvq
    from pykvq._lib import lib
    for name in ("NUQ4", "NUQ3", "BFP4_32", "BFP8_32", "Q4_0", "F16"):
        tid = getattr(pykvq, f"GGML_TYPE_{name}")
        assert pykvq.CACHE_TYPES[name.lower()] == tid
        assert lib().ggml_type_name(tid) is not None


# Run in a fresh interpreter: llama_cpp reads LLAMA_CPP_LIB_PATH once, at import (pykvq.use_with_llama_cpp sets it).
_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama
    path, type_name, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tid = getattr(pykvq, "GGML_TYPE_" + type_name.upper())
    llm = Llama(model_path=path, n_ctx=512, n_threads=2, type_k=tid, type_v=tid, flash_attn=True,
                logits_all=True, verbose=False, seed=0)   # scores are kept only with logits_all
    llm.eval(tokens)
    logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    chat = llm.create_chat_completion(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=24, temperature=0.0)
    llm.close()
    print(json.dumps({"lib": llama_cpp.llama_cpp._base_path.as_posix(), "logits": logits.tolist(),
                      "answer": chat["choices"][0]["message"]["content"],
                      "role": chat["choices"][0]["message"]["role"]}))
""")


@pytest.mark.parametrize("cache", ["nuq4", "bfp4_32"])
def test_llama_cpp_Llama_with_pykvq_cache(smollm2, passage, cache):
    from pykvq import Model
    m = Model(smollm2, n_ctx=512, cache_type_k=cache, cache_type_v=cache, flash_attn=True)
    try:
        tokens = m.tokenize(passage)[:200]
        ref = m.eval_logits(tokens)[-1].astype(np.float64)
        stdout = _child(_SCRIPT, str(smollm2), cache, json.dumps(tokens))
    finally:
        m.close()
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["lib"] == str(REPO / "build" / "bin")
    got = np.array(out["logits"])
    # the same library, graph and cache type: the same next-token distribution up to float reordering
    p, q = np.exp(ref - ref.max()), np.exp(got - got.max())
    p, q = p / p.sum(), q / q.sum()
    kld = float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30))))
    assert kld < 1e-4, kld
    assert int(np.argmax(got)) == int(np.argmax(ref))
    assert out["role"] == "assistant"
    assert "Paris" in out["answer"], out["answer"]


def test_pykvq_keeps_its_log_after_llama_cpp_is_imported(smollm2):
    """llama_cpp's import takes over libllama's log callback; a pykvq Model made afterwards takes it back, so
    its errors still quote llama.cpp."""
    out = _child("""
        import sys
        from pykvq import Model, log
        import llama_cpp
        m = Model(sys.argv[1], n_ctx=256)
        print(len(log.recent_text(5000)))
        m.close()
    """, str(smollm2))
    assert int(out.strip().splitlines()[-1]) > 1000


def test_settings_reach_llama_cpp_contexts_as_process_defaults(smollm2):
    """pykvq.use_with_llama_cpp(encoder=...) sets the process default every llama_cpp context takes (the library
    reads no environment variable itself; PYKVQ_* is the fallback of the argument). A refused value names its
    source."""
    code = """
        import sys, pykvq
        for kw, env in (({"encoder": "best"}, {}), ({}, {"PYKVQ_K_DOMAIN": "sideways"})):
            import os; os.environ.update(env)
            try:
                pykvq.use_with_llama_cpp(**kw)
            except pykvq.SettingError as e:
                print("refused:", e)
            os.environ.pop("PYKVQ_K_DOMAIN", None)
        pykvq.use_with_llama_cpp(encoder="lsq")
        from llama_cpp import Llama
        llm = Llama(model_path=sys.argv[1], n_ctx=256, type_k=pykvq.GGML_TYPE_Q4_0, flash_attn=True, verbose=True)
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(smollm2)], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "refused: encoder = 'best': expected auto, stock or lsq" in out
    assert "refused: PYKVQ_K_DOMAIN = 'sideways': expected auto, post, pre or centred" in out
    assert "q4_0 / q5_0 cache writes: least-squares block scales (the encoder setting)" in out
