"""The run's last drain sees the source's last metrics even when an earlier pop_metrics call was still outstanding
(asked before the source emitted them): the driver then does not validate the final weights a second time
(tests/integration/test_multi_job.py saw 4 validation phases for 3 validations, now and then, on a loaded machine)."""
import io

from fully_async.run.hydra_setup import load_config
from fully_async.run.run_logging import RunLogger

VAL = "val-core/arithmetic/reward/mean@1"


class StaleCalls:
    """Calls whose one outstanding pop_metrics was answered before the source's last emission: its answer is that
    older batch; a call asked now gets what the outbox holds now."""

    def __init__(self, old_batch, outbox):
        self.pending = {"sync.pop_metrics": (old_batch, 0.0)}
        self.outbox = outbox

    def get(self, key, start, deadline_s):
        if key in self.pending:
            return self.pending.pop(key)[0]
        out, self.outbox[:] = list(self.outbox), []
        return out


class Source:
    class pop_metrics:   # noqa: N801 - an actor handle's method: `.remote` issues the call (StaleCalls answers)
        remote = None


def test_the_last_drain_asks_again_after_an_outstanding_call():
    cfg = load_config(["trainer.logger=[console]", "trainer.progress_bar=false"])
    run_log = RunLogger(cfg, 6, [Source()], stream=io.StringIO(), names=["sync"])
    outbox = [(6, {VAL: 0.7})]                       # emitted after the outstanding call popped the outbox
    run_log.calls = StaleCalls([(6, {"timing_s/step": 1.0})], outbox)
    run_log.drain(deadline_s=1.0)
    assert run_log.has_val_at(6)                     # no second validation of step 6
    assert [s for s, _ in run_log.history] == [6] and outbox == []
    run_log.drain(deadline_s=1.0)                    # nothing outstanding: one call, nothing new
    assert len(run_log.val_history) == 1
