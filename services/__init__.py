"""Laneway services: each package is one process; they meet only through events."""
