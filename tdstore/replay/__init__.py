"""Replay-service collaborators of a ring buffer, kept on the server: rate limits (``rate_limit``)."""
