"""``tidespec bench kv``: sequences at once in the same KV memory, paged or in slots."""
