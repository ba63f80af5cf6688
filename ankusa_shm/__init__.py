"""ankusa-shm: a webhook edge whose processes share state through one shared-memory segment."""

__version__ = "0.1.0"
