"""The EAGLE-3 draft head: model, graphs, LoRA adapters, checkpoints."""
