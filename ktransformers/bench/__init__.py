"""bench: (filled in by later issues)."""
