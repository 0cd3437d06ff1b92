"""mindspeed.megatron_adaptor of the stand-in: logs its import and refuses to come after megatron (MindSpeed's
patches would miss modules megatron already bound)."""
import sys

from torch_npu import _standin

_standin.log("mindspeed_adaptor", megatron_already_imported="megatron" in sys.modules)
if "megatron" in sys.modules:
    _standin.refuse("mindspeed.megatron_adaptor after megatron", "import order")
