"""``tidespec bench invariance-cost``: what the row-invariant kernels cost plain decoding, per path.
"""
