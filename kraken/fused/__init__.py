"""Fused communication + compute recipes."""
