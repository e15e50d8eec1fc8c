"""recserve's embedding tier: batch data model, configs, parameter-server and worker cores.

This package imports neither ``training`` nor ``serving``; both build on it.
"""

__version__ = "0.1.0"
