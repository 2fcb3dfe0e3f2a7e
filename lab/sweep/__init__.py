"""Studies over composed configs: experiments (arms x seeds) and their ablation runner."""
