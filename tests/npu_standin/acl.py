"""A stand-in for CANN's `acl` (AscendCL) Python module, as far as Ray's NPU detection reads it: on the stand-in's
path, a Ray started here finds FA_NPU_STANDIN_DEVICES NPUs, as it finds the real ones on an Ascend node
(ray/_private/accelerators/npu.py).  Test-only, like torch_npu beside it."""
import os


class rt:  # noqa: N801 (acl.rt)
    @staticmethod
    def get_device_count():
        return int(os.environ.get("FA_NPU_STANDIN_DEVICES", "2")), 0


def get_soc_name():
    return "Ascend910B2"
