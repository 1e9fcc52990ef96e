"""Offline text and tasks from registry packages (see shared DATA.md)."""
