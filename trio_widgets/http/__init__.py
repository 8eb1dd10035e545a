"""Serving a LocalPool over HTTP in Tinker's wire protocol, and the clients that talk to it."""
