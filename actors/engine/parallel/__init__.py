"""Tensor parallelism (`--tp`): the sharding of a model's weights, the engine of each rank, the step plan rank 0
broadcasts, and the checks that a model and quantization can be sharded."""
