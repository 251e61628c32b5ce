"""``tidespec bench yield``: what online training costs serving on a shared CPU.

The package is not called ``yield`` because that is a Python keyword.
"""
