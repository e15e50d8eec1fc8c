"""recserve training package."""
