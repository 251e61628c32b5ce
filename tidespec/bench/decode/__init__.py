"""``tidespec bench decode``: plain-decoding throughput and latency per batch size.

``run`` (the command, and the wave runner other commands reuse), ``llamacpp`` (the same GGUF
through llama-cpp-python, as a baseline in the same run).
"""
