"""Trace replay."""
