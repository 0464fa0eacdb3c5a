"""jaxsys.data."""
