"""The trainer's rules, written once (core/trainer_state.py)."""
from fully_async.core.trainer_state import TrainerState


def test_push_every_trigger_steps_and_at_the_last_step():
    s = TrainerState(total_steps=7, trigger=3)
    pushed = []
    while not s.done():
        s.record([f"id{s.step}"], [5])
        if s.push_due():
            pushed.append((s.step, s.bump_version()))
    assert pushed == [(3, 1), (6, 2), (7, 3)]
    assert [s.step_of(v) for v in (1, 2, 3)] == [3, 6, 7]   # the final push belongs to the last step


def test_save_every_save_freq_versions_and_at_the_end_never_without_save_freq():
    s = TrainerState(total_steps=5, trigger=1, save_freq=2)
    saved = []
    for _ in range(5):
        s.record([], [])
        s.bump_version()
        if s.save_due():
            saved.append(s.version)
    assert saved == [2, 4, 5]
    off = TrainerState(total_steps=2, save_freq=-1)
    off.record([], [])
    off.bump_version()
    assert not off.save_due()


def test_checkpoint_json_round_trip_continues_the_trained_ids():
    s = TrainerState(total_steps=4, trigger=2)
    s.record(["a", "b"], [3, 4])
    s.record(["c"], [3])
    s.bump_version()
    saved = s.to_json("/m", "async")
    assert saved == {"step": 2, "version": 1, "trained_sample_ids": ["a", "b", "c"], "model_path": "/m",
                     "mode": "async"}
    t = TrainerState(total_steps=4, trigger=2)
    t.load_json(saved)
    t.record(["d"], [2])
    assert t.step == 3 and t.trained_sample_ids == ["a", "b", "c", "d"]
    assert t.result("ck", False)["response_lengths"] == {2: 1}   # lengths count the samples trained here


def test_of_a_config_sync_pushes_every_step():
    from fully_async.run.hydra_setup import load_config

    assert TrainerState.of(load_config(["mode=sync"]), 10).trigger == 1
    cfg = load_config(["async_training.trigger_parameter_sync_step=4", "trainer.save_freq=3"])
    s = TrainerState.of(cfg, 10)
    assert (s.trigger, s.save_freq, s.total_steps) == (4, 3, 10)
