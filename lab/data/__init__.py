"""Data: drafter training sequences, evaluation suites and the hidden-state cache."""
