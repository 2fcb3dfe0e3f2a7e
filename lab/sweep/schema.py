"""The old name of lab/sweep/spec_schema.py, kept only while lab/cli.py imports it (`MAX_TRIALS`); remove it
once the CLI imports lab.sweep.spec_schema. The very same module, not a copy (sys.modules points here too)."""

import sys

from lab.sweep import spec_schema

sys.modules[__name__] = spec_schema
