"""Exceptions pykvq raises; each message says what was wrong and what to do."""


class PykvqError(Exception):
    """Base class of every pykvq error."""


class LibraryNotFoundError(PykvqError, OSError):
    """The patched libllama has not been built (or PYKVQ_LIB is wrong)."""


class ModelLoadError(PykvqError, ValueError):
    """A model file is missing, not a GGUF, corrupt, or not loadable by this runtime."""


class CacheTypeError(PykvqError, ValueError):
    """Unknown KV-cache type, or one this model/context cannot use."""


class SettingError(PykvqError, ValueError):
    """A pykvq setting (k_domain, encoder, ...) given a value it does not take, or an unknown setting."""


class ContextOverflowError(PykvqError, ValueError):
    """The input does not fit into the context window."""


class DecodeError(PykvqError, RuntimeError):
    """llama_decode failed."""


class FetchError(PykvqError, RuntimeError):
    """A model or source package could not be fetched or failed its checksum."""
