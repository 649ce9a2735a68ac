"""redistribute."""
