"""``tidespec bench shift``: acceptance and speed over a domain-shift trace, frozen vs online drafters.

``config`` (configurations and flags), ``runs`` (one configuration's engine and trainer, turn by
turn), ``measure`` (capture overhead and stored-signal checks), ``run`` (the command: interleaved
turns, the document), ``report`` (tables and plots, also from a saved document).
"""
