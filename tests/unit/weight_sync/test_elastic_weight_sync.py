"""placement=elastic's weight sync: every push reaches the rollouter and the engines beside the trainer ranks (each
loading in its own process), so a lent engine always holds the pushed version."""
from fully_async.weight_sync import ElasticWeightSync


class Remote:
    def __init__(self):
        self.log = []

    def push(self, version):
        self.log.append(("push", version))
        return {"timing_s/param_sync": 1.0}

    def flush(self):
        self.log.append(("flush",))
        return {"timing_s/param_sync/wait": 0.5}


class Engines:
    def __init__(self):
        self.loads = []

    def load_everywhere(self, command, version):
        self.loads.append((command, version))


def test_a_push_reaches_the_rollouter_and_loads_every_trainer_engine_in_process():
    remote, engines = Remote(), Engines()
    sync = ElasticWeightSync(remote, engines)
    out = sync.push(3)
    assert remote.log == [("push", 3)] and engines.loads == [("load_trainer_weights", 3)]
    assert out["timing_s/param_sync"] == 1.0 and out["timing_s/param_sync/elastic_load"] >= 0
    assert sync.flush() == {"timing_s/param_sync/wait": 0.5} and remote.log[-1] == ("flush",)
