"""Losses over classifiers split across torch.distributed ranks (vocab_parallel.py)."""
