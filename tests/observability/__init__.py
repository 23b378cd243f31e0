"""Tracing, metrics, log safety and the startup report."""
