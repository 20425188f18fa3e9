"""Decoding: drafters, verification rules and the generate loop."""
