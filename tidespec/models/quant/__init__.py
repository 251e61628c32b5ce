"""Weight quantization: int8/int4 weight-only, w4a8/w8a8 (GGUF blocks times int8 activations)."""
