"""A fleet on Ray: N serving replicas behind one OpenAI-compatible ingress, one trainer for all.

Why this exists: one ``tidespec serve`` process captures signals, trains and swaps drafters for
itself alone; a deployment that outgrows one machine runs replicas behind a router, and TIDE's
point is that the whole fleet's traffic trains one drafter that every replica serves. Ray (Ray
Serve for the replicas, the routing and the restarts) is what our users already run for this.
Importing this package does not import Ray; ``deployments`` does (``pip install 'tidespec[fleet]'``).
"""
