"""Proxima's metrics: one catalog of names, and the exporters that publish them."""
