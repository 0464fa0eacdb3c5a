"""jaxsys.speculative."""
