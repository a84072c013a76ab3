"""Presentation: rich tables and matplotlib figures of plans and runs."""
