"""The algorithms of speculative decoding: token trees, sampling and verification,
the round and the loop, batching, fusion, pipelining, the lookup indexes and the
confidence calibration.

Each lives here once, as plain functions over a model of `runtime/`, with no
processes or network around them.
"""
