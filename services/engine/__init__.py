"""The engine package both worker services share: the Engine protocol and its implementations."""
