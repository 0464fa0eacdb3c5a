"""jaxsys.eval."""
