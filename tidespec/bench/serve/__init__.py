"""``tidespec bench serve``: an open-loop load generator for the OpenAI-compatible server, and the
helpers that launch and stop a server process (used by ``bench load``, ``bench memory`` and tests).
"""
