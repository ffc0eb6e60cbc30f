"""The version of quantkit (one place: pyproject.toml reads it too)."""

__version__ = "0.1.0"
