"""Test configuration. Its presence puts tests/ on sys.path, so test modules share tiny_models.py."""
