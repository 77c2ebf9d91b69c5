"""Text generation on a Model: sampling, chat-template prompts, stop strings, streaming."""
from __future__ import annotations

import codecs
from typing import Iterator

from . import log
from .errors import ContextOverflowError, PykvqError
from .stops import until_stop


class Generation:
    """Model's generate / chat (a mixin: Model supplies tokenize, apply_chat_template, token_bytes,
    reset, _decode, n_ctx, seed and the llama.cpp handles)."""

    def prompt_tokens(self, prompt: str, *, raw: bool = False, system: str | None = None) -> list[int]:
        text = None
        if not raw:
            msgs = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
            text = self.apply_chat_template(msgs)
        if text is None:
            return self.tokenize(prompt, add_special=True, parse_special=False)
        return self.tokenize(text, add_special=True, parse_special=True)

    def generate(self, prompt: str, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 0.95,
                 seed: int | None = None, stream: bool = False, raw: bool = False,
                 system: str | None = None, stop: str | list[str] | None = None):
        """Generate a reply to prompt (chat template applied unless raw=True or
        the model has none). temperature 0 is greedy. Returns the text, or with
        stream=True an iterator of text pieces. The reply ends before the first
        stop string (llama-cpp-python's and mlx-lm's `stop`)."""
        return self._reply(self.prompt_tokens(prompt, raw=raw, system=system), max_tokens, temperature, top_p,
                           seed, stream, stop)

    def chat(self, messages: list[dict], max_tokens: int = 128, temperature: float = 0.0, top_p: float = 0.95,
             seed: int | None = None, stream: bool = False, stop: str | list[str] | None = None):
        """The assistant's reply to a conversation, [{"role": "system"|"user"|"assistant", "content": ...}],
        rendered with the model's chat template (as llama_cpp.Llama.create_chat_completion does). Returns the
        text, or with stream=True an iterator of text pieces."""
        text = self.apply_chat_template(messages)
        if text is None:
            raise PykvqError(f"{self.path.name} has no chat template; use generate(prompt, raw=True)")
        return self._reply(self.tokenize(text, add_special=True, parse_special=True), max_tokens, temperature,
                           top_p, seed, stream, stop)

    def _reply(self, tokens, max_tokens, temperature, top_p, seed, stream, stop):
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"prompt is {len(tokens)} tokens, the context holds {self.n_ctx}; "
                "shorten the prompt or create the Model with a larger n_ctx")
        it = self._generate(tokens, max_tokens, temperature, top_p, self.seed if seed is None else seed)
        it = until_stop(it, [stop] if isinstance(stop, str) else stop)
        return it if stream else "".join(it)

    def _generate(self, tokens, max_tokens, temperature, top_p, seed) -> Iterator[str]:
        L = self._lib
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(top_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            self.reset()
            self._decode(tokens, 0)
            pos = len(tokens)
            for _ in range(max_tokens):
                tok = L.llama_sampler_sample(chain, self._ctx, -1)
                if L.llama_vocab_is_eog(self._vocab, tok):
                    break
                piece = dec.decode(self.token_bytes(tok))
                if piece:
                    yield piece
                if pos >= self.n_ctx:
                    log.logger.warning("pykvq: generation stopped at the context limit (%d)", self.n_ctx)
                    break
                self._decode([tok], pos)
                pos += 1
            tail = dec.decode(b"", final=True)
            if tail:
                yield tail
        finally:
            L.llama_sampler_free(chain)
