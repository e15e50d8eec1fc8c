"""recserve clients package."""
