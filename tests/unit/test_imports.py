"""Import hygiene, read from the source: vendor stacks stay lazy and in their own files, pure modules stay
free of Ray and torch, and only fully_async/device.py touches torch.cuda / torch.npu."""
import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fully_async")
VENDORS = {"vllm": {"engines/vllm_engine.py"}, "torch_npu": {"device.py"},
           "megatron": {"backends/megatron_backend.py", "backends/hf_megatron.py"}, "mindspeed": {"backends/megatron_backend.py"}}
PURE = ["scheduler.py", "staleness.py", "workload.py", "partial.py", "types.py", "queue.py", "flops.py"]


def sources():
    for root, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PKG), ast.parse(open(path).read(), path)


def imported(node):
    if isinstance(node, ast.Import):
        return [a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module.split(".")[0]]
    return []


def top_level_imports(tree):
    """Imports that run when the module is imported (module body, including if/try blocks at top level)."""
    out, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        out += imported(node)
        if isinstance(node, (ast.If, ast.Try)):
            stack += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_vendor_stacks_are_imported_lazily_and_only_in_their_own_files(vendor):
    for rel, tree in sources():
        everywhere = [m for n in ast.walk(tree) for m in imported(n)]
        if vendor in everywhere:
            assert rel in VENDORS[vendor], f"{rel} imports {vendor}"
        assert vendor not in top_level_imports(tree), f"{rel} imports {vendor} at module level"


def test_only_device_py_touches_torch_cuda_or_npu():
    for rel, tree in sources():
        if rel == "device.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("cuda", "npu") and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                pytest.fail(f"{rel}:{node.lineno} uses torch.{node.attr}; go through fully_async.device")


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_import_neither_ray_nor_torch_at_module_level(rel):
    tree = ast.parse(open(os.path.join(PKG, rel)).read())
    assert not {"ray", "torch"} & set(top_level_imports(tree)), rel
