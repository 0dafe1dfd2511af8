"""engine: (filled in by later issues)."""
