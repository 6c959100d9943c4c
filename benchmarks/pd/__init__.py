"""A small real serving engine for the prefill/decode question: a Llama-style decoder over a paged KV cache,
continuous batching with prefill-first, chunked and disaggregated (prefill-only / decode-only) policies,
trace replay in real time, and per-request timing. ``python -m benchmarks.pd run --help``."""
