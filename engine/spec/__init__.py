"""Speculative decoding: drafters, when to speculate, verification."""
