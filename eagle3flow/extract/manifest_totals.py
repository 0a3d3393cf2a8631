"""The hidden-state manifest keys that add up over partitions (every other key must agree).

Torch-free on purpose: extract/shards.py (merging partition manifests) and the
torch-free streaming planner (ops/streaming.py, recording a streamed run's manifest)
both sum them, and ops/ never imports torch.
"""

SUMMED_KEYS = ("num_samples", "num_tokens", "num_loss_tokens", "truncated_samples", "dropped_samples")
