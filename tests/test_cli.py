"""The `lab` command's registry (lab/cli/registry.py): its summaries are the verbs' own help, and `lab --help`
lists every verb without importing any verb's module (nor torch, MLflow or Optuna)."""

from __future__ import annotations

import importlib
import subprocess
import sys

from lab.cli import build_parser
from lab.cli.common import Verb, help_paragraphs
from lab.cli.registry import COMMANDS


def test_the_registry_says_what_each_verb_says_of_itself():
    """A summary in the registry is the first paragraph of the verb's handler's docstring (of a group: of its
    module's), so that `lab -h` and the module say the same."""
    for name, command in COMMANDS.items():
        if command.module is None:
            continue
        module = importlib.import_module(command.module)
        if command.attr is None:
            assert help_paragraphs(module.__doc__)[0] == command.summary, name
        else:
            verb = getattr(module, command.attr)
            assert isinstance(verb, Verb) and verb.summary == command.summary, name


def test_every_verb_has_a_handler_in_the_full_parser():
    parser = build_parser()
    assert parser.parse_args(["doctor"]).handler.__module__ == "lab.cli.doctor"
    assert parser.parse_args(["study", "import", "x.tar.gz"]).handler.__module__ == "lab.cli.study"


def test_help_imports_no_verb_module():
    script = (
        "import sys\nfrom lab.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    loaded = set(proc.stderr.split())
    assert all(verb in proc.stdout for verb in ("run", "torchspec-config", "study"))
    verb_modules = {c.module for c in COMMANDS.values() if c.module is not None}
    assert not verb_modules & loaded, verb_modules & loaded
    assert not {"torch", "mlflow", "optuna"} & loaded


def test_transformers_loads_its_models_without_scikit_learn():
    """lab/__init__.py: in a process that imports lab, transformers' generation utilities load without importing
    scikit-learn, which is installed (mlflow needs it, and transformers would import it), and say it is absent."""
    script = (
        "import importlib.util, sys\nimport lab\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from transformers.utils import is_sklearn_available\n"
        "print(importlib.util.find_spec('sklearn') is not None, is_sklearn_available(), 'sklearn' in sys.modules)"
    )
    said = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert said == "True False False\n"
