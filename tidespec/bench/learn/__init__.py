"""``tidespec bench learn``: how an EAGLE-3 head's acceptance grows with its training signals.
"""
