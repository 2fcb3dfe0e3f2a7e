"""Drafter training: the native TTT trainer."""
