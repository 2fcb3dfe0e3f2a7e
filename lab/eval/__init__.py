"""Evaluation: the reference speculative decoder and its metrics."""
