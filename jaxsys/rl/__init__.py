"""jaxsys.rl."""
