"""cache: (filled in by later issues)."""
