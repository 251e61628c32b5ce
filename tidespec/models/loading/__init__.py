"""Checkpoints in: HF directories, GGUF files (converted once), the embedded model."""
