"""jaxsys.cluster."""
