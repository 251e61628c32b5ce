"""``tidespec bench fleet``: a fleet's one trainer vs one trainer per server (``run.py``)."""
