"""Model clients behind one small protocol."""
