"""``tidespec bench quality``: how far a quantized (or bfloat16) target is from the float32 model.
"""
