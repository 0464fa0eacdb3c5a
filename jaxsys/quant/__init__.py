"""jaxsys.quant."""
