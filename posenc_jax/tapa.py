"""Placeholder: being written (see issue 2)."""
