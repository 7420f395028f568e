"""Pieces shared by every kernel family."""
