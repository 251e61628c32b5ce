"""``tidespec bench load``: policies under a rate sweep and a dynamic trace, each on a fresh server.

``config`` (the configurations and their server flags), ``run`` (launching and driving the servers),
``analysis`` (pure functions of the runs' results), ``report`` (tables and plots).
"""
