"""Laneway's event contract: versioned, frozen pydantic models shared by every service."""
