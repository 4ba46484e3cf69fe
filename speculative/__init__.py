"""The shared core of specserve: model, loading, sampling, verification, token trees.

Plain PyTorch, no processes or network: every algorithm lives here once.
"""
