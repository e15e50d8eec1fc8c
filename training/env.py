"""Environment variables that connect recserve processes (no broker: peers by address)."""

#: Comma-separated embedding-worker addresses; unset = embedded in-process tier.
EMBEDDING_WORKERS_ENV = "RECSERVE_EMBEDDING_WORKERS"
#: Comma-separated HOST:PORT of the NN workers' data receivers, in rank order.
NN_WORKERS_ENV = "RECSERVE_NN_WORKER_ADDRESSES"
#: This data loader's replica index and the number of data-loader replicas.
REPLICA_INDEX_ENV = "RECSERVE_REPLICA_INDEX"
REPLICA_SIZE_ENV = "RECSERVE_REPLICA_SIZE"
#: How many data loaders stream into each NN worker.
NUM_LOADERS_ENV = "RECSERVE_NUM_DATA_LOADERS"
