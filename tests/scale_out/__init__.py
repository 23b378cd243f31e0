"""More than one process per role: scheduler replicas, tensor parallelism, KV sharing, the router, workers and
replica claims, NATS clusters."""
