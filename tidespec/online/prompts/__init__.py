"""Prompt generators for training (``synth-prompts``: the target writes its own queries;
``mine-prompts``: code prompts from documented functions), run as commands, not while serving."""
