"""Small builders shared by tests."""
import torch

from fully_async.core.types import Sample


def tiny_samples(seed: int = 0, groups: int = 2, n: int = 2, vocab: int = 21):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(groups):
        prompt = torch.randint(2, vocab, (4,), generator=g).tolist()
        for j in range(n):
            resp = torch.randint(2, vocab, (3,), generator=g).tolist()
            out.append(Sample(uid=f"g{gi}", sample_id=f"g{gi}-{j}", prompt_ids=prompt, response_ids=resp,
                              rollout_log_probs=[-1.0] * 3, versions=[0] * 3, reward=float(j)))
    return out


def read_scalars(logdir):
    """{tag: [(step, value), ...]} of a TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def ray_session(num_cpus: int, **env: str):
    """A local Ray for one test module (use with `yield from` in a module-scoped fixture)."""
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}})
    yield
    ray.shutdown()
