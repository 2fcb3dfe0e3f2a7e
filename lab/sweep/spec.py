"""The old name of lab/sweep/search_space.py, kept only while lab/cli.py imports it (`spec.load`, `blame`, ...);
remove it once the CLI imports lab.sweep.search_space. The very same module, not a copy (sys.modules points here
too), so that a test's monkeypatch of either name reaches both."""

import sys

from lab.sweep import search_space

sys.modules[__name__] = search_space
