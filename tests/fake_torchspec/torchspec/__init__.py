"""A stand-in TorchSpec for tests/test_torchspec.py: importable, with `torchspec.models.eagle3`, and without the
MLA drafter (`torchspec.models.draft.deepseek_eagle`), as a TorchSpec from before it was added."""
