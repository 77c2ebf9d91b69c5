#pragma once

// pykvq over llama.cpp's RPC backend (patch 0013-kvq-rpc). pykvq's cache types and their node parameters
// (codebooks and pre-RoPE tags in op_params, src[5..8]) travel in ggml-rpc's tensor serialisation unchanged;
// what a stock worker lacks is the code to run them. A pykvq worker answers HELLO with this byte in the
// response's padding, where a stock worker sends 0, and a pykvq client refuses any other value.
// High bit: pykvq; low bits: the layout of pykvq's node parameters. Bump it when that layout changes.
#define GGML_KVQ_RPC_MARK 0x81
