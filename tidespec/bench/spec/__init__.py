"""``tidespec bench spec``: drafters x gamma against plain decoding on one workload.
"""
