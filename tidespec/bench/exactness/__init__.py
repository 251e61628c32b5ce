"""``tidespec bench exactness``: is every path's greedy output exactly plain decoding's?
"""
