"""Empty: only importable (lab/preflight.py probes it)."""
