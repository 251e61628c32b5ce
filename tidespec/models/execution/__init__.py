"""How a target forward runs: eager, compiled, CUDA graphs; row invariance; device placement."""
