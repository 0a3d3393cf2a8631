"""The GPU lane, a package so that its conftest is gpu.conftest and never shadows tests/conftest.py."""
