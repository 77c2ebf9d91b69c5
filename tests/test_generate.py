"""Generation on the real default model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import pytest

import pykvq
from pykvq import Model

QUESTION = "What is the capital of France?"


def test_greedy_answer_names_paris(f16_model):
    out = f16_model.generate(QUESTION, max_tokens=32)
    assert "Paris" in out


def test_stream_matches_non_stream(f16_model):
    whole = f16_model.generate(QUESTION, max_tokens=24)
    pieces = list(f16_model.generate(QUESTION, max_tokens=24, stream=True))
    assert len(pieces) > 3 and "".join(pieces) == whole


def test_quantized_cache_still_answers(q8_model):
    assert "Paris" in q8_model.generate(QUESTION, max_tokens=32)


def test_chat_template_is_used_unless_raw(f16_model):
    chat = f16_model.prompt_tokens(QUESTION)
    raw = f16_model.prompt_tokens(QUESTION, raw=True)
    assert len(chat) > len(raw)
    assert "<|im_start|>" in f16_model.detokenize(chat, special=True)
    assert f16_model.detokenize(raw) == QUESTION


def test_sampling_is_seeded(f16_model):
    a = f16_model.generate("Tell me a story.", max_tokens=16, temperature=0.9, seed=7)
    b = f16_model.generate("Tell me a story.", max_tokens=16, temperature=0.9, seed=7)
    assert a == b


def test_tokenize_round_trip(f16_model):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓"
    assert f16_model.detokenize(f16_model.tokenize(text, add_special=False)) == text


def test_top_level_generate(smollm2):
    out = pykvq.generate(QUESTION, max_tokens=24)
    assert "Paris" in out


def test_context_limit_stops_generation(smollm2, caplog):
    with Model(smollm2, n_ctx=256) as m:
        prompt = "Count from one to five hundred in words. " + "Go on. " * 40
        n_prompt = len(m.prompt_tokens(prompt, raw=True))
        pieces = list(m.generate(prompt, max_tokens=1000, raw=True, stream=True))
        # each token yields at most one piece; the cache never overflows
        assert 0 < len(pieces) <= 256 - n_prompt + 1
        assert "context limit" in caplog.text


def test_until_stop_holds_back_split_stop_strings():
    from pykvq.stops import until_stop
    assert list(until_stop(["Hel", "lo wo", "rld"], None)) == ["Hel", "lo wo", "rld"]
    # "\n\nQ" arrives in three pieces: nothing of it is ever shown
    assert "".join(until_stop(["Paris.", "\n", "\nQ", "uestion"], ["\n\nQ"])) == "Paris."
    assert list(until_stop(["ab", "c", "d"], ["cd", "x"])) == ["ab"]
    assert "".join(until_stop(["a\n", "b"], ["\n\n"])) == "a\nb"          # a held-back prefix that was not a stop
    assert list(until_stop(["stop here"], ["stop"])) == []


def test_chat_messages_stream_and_stop(f16_model):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = f16_model.chat(msgs, max_tokens=32)
    assert "Paris" in whole and whole == f16_model.generate(msgs[0]["content"], max_tokens=32)
    assert "".join(f16_model.chat(msgs, max_tokens=32, stream=True)) == whole
    cut = f16_model.chat(msgs, max_tokens=32, stop=["Paris"])
    assert whole.startswith(cut) and "Paris" not in cut and len(cut) < len(whole)
    assert f16_model.generate("What is the capital of France?", max_tokens=32, stop=".").count(".") == 0


def test_model_is_a_context_manager(smollm2):
    with Model(smollm2, n_ctx=256) as m:
        assert m.generate("Hi", max_tokens=2) is not None
    assert m._ctx == pykvq._lib.ffi.NULL
