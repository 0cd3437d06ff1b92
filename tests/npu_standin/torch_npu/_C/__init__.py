"""torch_npu._C of the stand-in: only the distributed bindings the package imports."""
