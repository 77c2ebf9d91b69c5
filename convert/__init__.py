"""pykvq's converter: transforms baked into a GGUF's attention weights.

to_gguf.py is the command line; the math lives in one module per transform
(rope_layout, ksort, smooth, hadamard), the I/O in gguf_io and rows, the
activation statistics in calib.
"""
