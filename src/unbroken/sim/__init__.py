"""Cluster simulator (placeholder docstring)."""
