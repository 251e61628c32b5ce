"""The KV caches: slot cache, paged cache, prefix-cache block storage."""
