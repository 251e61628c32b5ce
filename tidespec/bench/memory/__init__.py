"""``tidespec bench memory``: the server's resident memory after a burst of large rejected requests.
"""
