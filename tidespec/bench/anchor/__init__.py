"""``tidespec bench anchor``: plain decoding of a model shape against the compiled static-shape anchor.

``run`` (the command and the model shapes), ``model`` (the anchor: a static-shape, compiled decode).
"""
