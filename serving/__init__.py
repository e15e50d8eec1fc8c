"""recserve serving package."""
