"""torch_npu._C._distributed_c10d of the stand-in."""
from torch_npu._dist import ProcessGroupHCCL

__all__ = ["ProcessGroupHCCL"]
