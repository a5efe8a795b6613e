"""The persistent checkpoint cache on disk."""
