"""Sans-IO protocol core: pure functions and data, never trio (a test enforces it)."""
