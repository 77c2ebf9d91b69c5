"""numpy reference implementations of pykvq's cache formats.

One module per format family; the C code in native/ is tested against these
bit for bit (quantize, dequantize) or to a stated tolerance (dot products).
"""
from . import bfp  # noqa: F401
