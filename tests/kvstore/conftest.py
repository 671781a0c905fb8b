"""A local Ray cluster for the object-store tier tests (tests/conftest.py)."""
