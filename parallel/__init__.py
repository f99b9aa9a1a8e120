"""The rank worker and its instance: process groups, the Ray ranks of an instance, the model
runner that executes the engine's step plans on a model shard (batch preparation, sampling,
CUDA graphs, pipeline stages, expert slots, KV tiers), and elastic expert parallelism."""
