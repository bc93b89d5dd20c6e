"""The package version, in one place: the package top exports it, pyproject.toml reads it, the CLI prints it."""
__version__ = "0.1.0"
