"""LeaseClient.renew between two engine steps: it never waits for the pool.  It sends its question at most every
renew_every_s and answers from the pool's last reply until the next one is there."""
import concurrent.futures

from fully_async.placement import device_pool


class FakePool:
    def __init__(self):
        self.asked: list[concurrent.futures.Future] = []
        pool = self

        class Renew:
            @staticmethod
            def remote(job, holder):
                fut = concurrent.futures.Future()
                pool.asked.append(fut)
                return type("Ref", (), {"future": lambda self: fut})()

        self.renew = Renew


def test_renew_asks_without_waiting_and_answers_from_the_last_reply(monkeypatch):
    pool = FakePool()
    monkeypatch.setattr(device_pool, "get_pool", lambda name: pool)
    client = device_pool.LeaseClient("p", "job", [0], side="rollout", renew_every_s=0.0)
    assert client.renew() is False and not pool.asked          # holding nothing: nothing to ask
    client.current = device_pool.Phase("rollout", 0.0, [0])
    assert client.renew() is False and len(pool.asked) == 1   # asked; no reply yet: the last answer (none wanted)
    assert client.renew() is False and len(pool.asked) == 1   # still on its way: not asked twice, not waited for
    pool.asked[0].set_result(True)                            # someone waits for these devices
    assert client.renew() is True and len(pool.asked) == 1
    assert client.renew() is True and len(pool.asked) == 2    # the next question, answered from the last reply
