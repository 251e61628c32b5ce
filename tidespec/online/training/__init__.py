"""The online loop's part that runs in the trainer child (``tidespec train-drafter``): rounds over the
signal store, EAGLE-3 training and distillation, LoRA alignment, publishing. It never imports the
serving process's code; what the two share (the signal store, capture, the round log) lives in
``tidespec.online`` itself."""
