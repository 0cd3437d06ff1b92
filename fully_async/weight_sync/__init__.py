"""WeightSync implementations (layer 2): how the trainer's weights reach the rollout engines."""
from fully_async.weight_sync.local import LocalWeightSync
from fully_async.weight_sync.object_store import ObjectStoreWeightSync

__all__ = ["LocalWeightSync", "ObjectStoreWeightSync"]
