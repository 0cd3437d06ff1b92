"""Import hygiene, read from the source: the layers import downwards only (core <- the domain packages algorithms,
rewards, verl, planner, telemetry <- cluster <- placement <- weight_sync <- rollout / train <- actors <- run <-
compare), nothing below cluster imports Ray, vendor stacks stay lazy and in their own files, pure modules
stay free of Ray and torch, and only fully_async/device.py touches torch.cuda / torch.npu."""
import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fully_async")
VENDORS = {"vllm": {"rollout/engines/vllm_engine.py"}, "torch_npu": {"device.py"},
           "megatron": {"train/backends/megatron_backend.py", "train/backends/hf_megatron.py",
                        "train/backends/megatron_critic.py", "train/backends/megatron_lora.py"},
           "mindspeed": {"train/backends/megatron_backend.py"}}
PURE = ["rollout/scheduler.py", "core/staleness.py", "core/workload.py", "core/partial.py", "core/types.py",
        "actors/queue.py", "core/flops.py", "placement/leases.py", "planner/pipeline_sim.py", "planner/memory_model.py",
        "planner/hardware.py", "planner/search.py", "planner/stage_costs.py", "planner/sim_engine.py",
        "planner/colocated_sim.py", "device_memory/policy.py"]
# a layer may import only from layers of a lower rank (and from itself); the entry shims sit above everything
ROOT_MODULES = ("__init__.py", "main.py", "doctor.py", "plan.py", "device.py")   # entry shims; device.py is layer 0
# core is the shared base; the domain packages of layer 1 build on it and never on each other
LAYERS = {"core": 0, "device_memory": 0, "algorithms": 1, "rewards": 1, "verl": 1, "planner": 1, "telemetry": 1,
          "cluster": 2, "placement": 3, "weight_sync": 4, "rollout": 5, "train": 5, "actors": 6, "run": 7, "compare": 8}
NO_RAY = {"core", "device_memory", "algorithms", "rewards", "verl", "planner", "telemetry"}


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


def layer_of(rel):
    top = rel.split(os.sep)[0]
    return LAYERS.get(top), top


def test_every_module_sits_in_a_layer():
    stray = [rel for rel, _ in sources() if os.sep not in rel and rel not in ROOT_MODULES]
    assert stray == [], "modules at the package root other than the entry shims and device.py"


def test_device_py_is_layer_zero():
    """device.py stays at the package root (the one file that knows the accelerator) and, like core, imports
    nothing else of the package and never Ray."""
    tree = ast.parse(open(os.path.join(PKG, "device.py")).read())
    names = [m for n in ast.walk(tree) for m in imported(n)]
    assert "ray" not in names and "fully_async" not in names


def test_layers_import_downwards_only_and_nothing_below_cluster_imports_ray():
    bad = []
    for rel, tree in sources():
        rank, layer = layer_of(rel)
        if rank is None:
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                parts = name.split(".")
                if layer in NO_RAY and parts[0] == "ray":
                    bad.append(f"{rel} imports ray")
                if parts[0] == "fully_async" and len(parts) > 1 and parts[1] in LAYERS:
                    other = LAYERS[parts[1]]
                    if other > rank or (other == rank and parts[1] != layer):
                        bad.append(f"{rel} ({layer}) imports {name}")
    assert bad == []


def test_metric_names_do_not_carry_the_package_layout():
    """Metric names such as fully_async/rollouter/idle_ratio are verl-style names, not file paths: a string that
    looks like fully_async/<layer>/<x>/ must name a real folder of the package."""
    import re

    pattern = re.compile(r"fully_async/(" + "|".join(LAYERS) + r")/([a-z_]+)/")
    bad = []
    for rel, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for layer, name in pattern.findall(node.value):
                    if not os.path.isdir(os.path.join(PKG, layer, name)):
                        bad.append(f"{rel}: {node.value!r}")
    assert bad == []


def test_every_package_opens_with_what_lives_there_and_who_may_import_it():
    """Each package's __init__.py is one paragraph: what lives there and which layers may import it."""
    for top in LAYERS:
        init = os.path.join(PKG, top, "__init__.py")
        assert os.path.exists(init), f"{top}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse(open(init).read())) or ""
        assert "import" in doc and len(doc) > 120, f"{top}/__init__.py does not say what lives there and who imports it"


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (no packages under tests/): two files of one name fail collection."""
    import collections

    tests = os.path.abspath(os.path.join(PKG, os.pardir, "tests"))
    names = collections.Counter(f for _, _, files in os.walk(tests) for f in files
                                if f.startswith("test_") and f.endswith(".py"))
    assert [n for n, k in names.items() if k > 1] == []
