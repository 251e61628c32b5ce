"""``tidespec bench profile``: the cost model speculation lives on, T(n) per batch size.
"""
