"""``tidespec bench``: one subpackage per benchmark command, ``cli`` builds their flags.

Each command's package holds its ``run`` module (config, measurement, report); ``common`` holds what
they share (the run document in ``report``, the first-divergence analysis in ``divergence``).
"""
