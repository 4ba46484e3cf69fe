"""The model runtime: the decoder and its KV cache, loading weights and tokenizers,
quantisation, the CPU kernels and their tuning, tensor parallelism.

How a model runs, not what speculative decoding does with it (`speculative/`):
plain PyTorch, no processes or network, no environment variables (the commands
read those at the edge and pass their values in).
"""
