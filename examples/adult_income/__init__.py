"""The UCI Adult (census income) example: data pipeline, model and hyperparameters."""
