"""``tidespec bench prefix``: what automatic prefix caching saves and costs."""
