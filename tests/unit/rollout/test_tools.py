"""Multi-turn tool rollouts (rollout/tools.py, verl's tool agent loop): the tool YAML, hermes parsing, the tool
answers in the chat template outside the loss, the turn limits and the budget, and the scheduler's interplay with
interrupts, checkpoints and resumes -- over a scripted engine that writes tool calls, and a local SandboxFusion."""
import json
import textwrap
import time
from collections import deque
from types import SimpleNamespace

import pytest

from chat_helpers import build_chat_tokenizer
from fully_async.core.config import ConfigError, MultiTurnConfig
from fully_async.core.data import PromptStream
from fully_async.core.partial import PendingResponse
from fully_async.core.staleness import StalenessManager
from fully_async.core.state_files import read_state, write_state
from fully_async.core.types import GenOutput, PromptRecord, SamplingParams
from fully_async.rollout.generation import group_pendings, score_samples
from fully_async.rollout.scheduler import RolloutScheduler
from fully_async.rollout.tools import (SandboxCodeTool, ToolLoop, load_tools, parse_hermes, retool_code,
                                       truncate)
from sandbox_helpers import Sandbox

CALC = {"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


class Calc:
    """A user tool (`tests...:Calc`): evaluates "a+b"; sleeps `delay_s` first."""

    def __init__(self, config, tool_schema):
        self.delay_s = float(config.get("delay_s", 0.0))

    def execute(self, arguments):
        time.sleep(self.delay_s)
        a, b = arguments["expr"].split("+")
        return str(int(a) + int(b))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(str(tmp_path_factory.mktemp("chat_tok")))


def call(expr, name="calc"):
    return f'<tool_call>{json.dumps({"name": name, "arguments": {"expr": expr}})}</tool_call>'


class ToolCallingEngine:
    """One token per collect(); a response's k-th turn (k = tool answers in its context so far) writes
    `script[k]` then EOS; log-probs -0.1 * (version + 1); interrupt() returns partials."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, [tok.encode(s, add_special_tokens=False) for s in script]
        self.version, self.waiting, self.running = 0, deque(), {}

    def submit(self, requests):
        self.waiting.extend(requests)

    def num_in_flight(self):
        return len(self.waiting) + len(self.running)

    def collect(self, timeout_s=0.05):
        while self.waiting:
            r = self.waiting.popleft()
            self.running[r.request_id] = [r, []]
        done = []
        for rid, (req, toks) in list(self.running.items()):
            context = self.tok.decode(req.prompt_ids + toks)
            turn = self.script[min(context.count("<tool_response>"), len(self.script) - 1)]
            so_far = len(req.prompt_ids) + len(toks) - self._turn_start(req.prompt_ids + toks)
            toks.append(turn[so_far] if so_far < len(turn) else self.tok.eos_token_id)
            if toks[-1] == self.tok.eos_token_id or len(toks) >= req.params.max_tokens:
                done.append(self._out(rid, "stop" if toks[-1] == self.tok.eos_token_id else "length"))
        return done

    def _turn_start(self, ids):
        """Where the current assistant turn begins: after the last "<|im_start|>assistant\\n"."""
        text = self.tok.decode(ids)
        return len(self.tok.encode(text[:text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")],
                                   add_special_tokens=False))

    def _out(self, rid, reason):
        _, toks = self.running.pop(rid)
        return GenOutput(rid, toks, [-0.1 * (self.version + 1)] * len(toks), [self.version] * len(toks), reason)

    def interrupt(self):
        return [self._out(rid, "abort") for rid in list(self.running)]

    def update_weights(self, named, version):
        self.version = version


def prompt_ids(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "what is 1+2?"}], tools=[CALC],
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def loop(tok, **kw):
    return ToolLoop(MultiTurnConfig(enable=True, **kw), [_calc()], tok)


def _calc(delay_s=0.0):
    tool = Calc({"delay_s": delay_s}, CALC)
    tool.name, tool.schema = "calc", CALC
    return tool


def pend(tok, sid="s0", max_tokens=400):
    return PendingResponse("g0", sid, prompt_ids(tok), SamplingParams(1.0, 1.0, -1, max_tokens))


def answer_ids(tok, *texts):
    """The tokens verl appends for tool answers: the chat template's tool turn and the next assistant header,
    without the template's default system prompt."""
    ids = tok.apply_chat_template([{"role": "tool", "content": t} for t in texts], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    system = tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", add_special_tokens=False)
    assert ids[:len(system)] == system
    return ids[len(system):]


def test_a_tool_call_gets_its_answer_outside_the_loss_and_the_policy_continues(tok):
    first, second = call("1+2"), "The answer is \\boxed{3}."
    engine = ToolCallingEngine(tok, [first, second])
    p = pend(tok)
    loop(tok).drive(engine, [p])
    enc = lambda s: tok.encode(s, add_special_tokens=False)   # noqa: E731
    eos = [tok.eos_token_id]
    appended = answer_ids(tok, "3")
    assert tok.decode(appended) == "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" \
                                   "<|im_start|>assistant\n"
    assert p.token_ids == enc(first) + eos + appended + enc(second) + eos
    s = p.to_sample()
    assert s.response_mask == [1] * (len(enc(first)) + 1) + [0] * len(appended) + [1] * (len(enc(second)) + 1)
    assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.response_mask) if m == 0)
    assert all(lp == pytest.approx(-0.1) for lp, m in zip(s.rollout_log_probs, s.response_mask) if m == 1)
    assert s.num_turns == 3 and s.finish_reason == "stop"    # two assistant turns, one tool answer


def test_the_loop_stops_at_the_turn_limits_the_budget_and_a_turn_without_calls(tok):
    enc_len = len(tok.encode(call("1+2"), add_special_tokens=False)) + 1
    many = ToolCallingEngine(tok, [call("1+2")])               # calls a tool at every turn
    p = pend(tok)
    loop(tok, max_assistant_turns=3).drive(many, [p])
    assert (p.assistant_turns, p.user_turns) == (3, 2)
    p = pend(tok)
    loop(tok, max_user_turns=1).drive(many, [p])
    assert (p.assistant_turns, p.user_turns) == (2, 1)
    # the budget: a tool answer that would reach it is not appended, and the response ends there
    p = pend(tok, max_tokens=enc_len + len(answer_ids(tok, "3")))
    loop(tok).drive(many, [p])
    assert (p.assistant_turns, p.user_turns) == (1, 0) and p.mask == [] and len(p.token_ids) == enc_len
    p = pend(tok)
    loop(tok).drive(ToolCallingEngine(tok, ["no tools needed"]), [p])
    assert (p.assistant_turns, p.user_turns) == (1, 0) and p.to_sample().response_mask is None


def test_failing_unknown_and_parallel_calls_answer_as_verl(tok):
    engine = ToolCallingEngine(tok, [call("1+2") + call("x+1") + call("2+2", name="nope") + call("3+3"), "done"])
    p = pend(tok)
    loop(tok, max_parallel_calls=3).drive(engine, [p])
    text = tok.decode(p.token_ids)
    assert "<tool_response>\n3\n</tool_response>" in text
    assert "<tool_response>\nError when executing tool: invalid literal for int() with base 10: 'x'\n" in text
    assert "<tool_response>\nError when executing tool: 'nope'\n" in text
    assert "6" not in text.split(call("3+3"))[1]                # the fourth call is beyond max_parallel_calls
    assert text.count("<tool_response>") == 3


def test_hermes_parsing_and_verls_truncation():
    calls = parse_hermes('a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b'
                         '<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>'
                         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parse_hermes("<tool_call> never closed") == []
    assert truncate("abcdefghij", 4, "left") == "abcd...(truncated)"
    assert truncate("abcdefghij", 4, "right") == "(truncated)...ghij"
    assert truncate("abcdefghij", 4, "middle") == "ab...(truncated)...ij"
    assert truncate("abc", 4, "middle") == "abc"
    assert retool_code("```python\nx = 2\nx * 3\n```") == "x = 2\nprint(x * 3)"
    assert retool_code("print(1)\n\n") == "print(1)\n\n"


def write_yaml(tmp_path, body):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_verls_tool_yaml_builds_the_sandbox_tool_and_user_tools(tmp_path, tok):
    box = Sandbox()
    try:
        path = write_yaml(tmp_path, f"""
            tools:
              - class_name: recipe.retool.retool.CustomSandboxFusionTool
                config: {{sandbox_fusion_url: "{box.url}", num_workers: 8, default_timeout: 5, type: native}}
                tool_schema:
                  type: function
                  function: {{name: code_interpreter, description: runs code,
                             parameters: {{type: object, properties: {{code: {{type: string}}}}}}}}
              - class_name: "test_tools:Calc"
                config: {{}}
                tool_schema: {json.dumps(CALC)}
            """)
        code, calc = load_tools(path)
        assert isinstance(code, SandboxCodeTool) and code.retool and code.timeout == 5
        assert calc.name == "calc" and calc.execute({"expr": "2+5"}) == "7"
        assert code.execute({"code": "```python\nx = 6\nx * 7\n```"}) == "42\n"   # retool prints the last line
        # stdout then stderr; retool printed the last line's value too (write returns 1)
        assert code.execute({"code": "import sys\nprint('a')\nsys.stderr.write('b')"}) == "a\n1\nb"
        assert code.execute({"code": "while True:\n    pass\nprint(1)", "timeout": 1}) == "no stdout here"
    finally:
        box.close()


def test_sandbox_calls_are_bounded_as_verls_workers_and_rate_limit():
    import concurrent.futures

    box = Sandbox(delay_s=0.2)
    try:
        schema = {"type": "function", "function": {"name": "code_interpreter"}}
        tool = SandboxCodeTool({"sandbox_fusion_url": box.url, "num_workers": 4, "rate_limit": 2}, schema)
        assert tool.max_concurrent == 2
        assert SandboxCodeTool({"sandbox_fusion_url": box.url, "num_workers": 3,
                                "enable_global_rate_limit": False}, schema).max_concurrent == 3
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(lambda i: tool.execute({"code": f"print({i})"}), range(6))) == \
                [f"{i}\n" for i in range(6)]
        assert box.peak == 2
    finally:
        box.close()


@pytest.mark.parametrize("body,message", [
    ("tools: []", "has no `tools:` list"),
    ("tools:\n  - config: {}", r"tools\[0\] has no class_name"),
    ("tools:\n  - class_name: a.b.SearchTool\n    tool_schema: {function: {name: s}}",
     "'a.b.SearchTool' is not one this package runs: verl's verl.tools.sandbox_fusion_tools.SandboxFusionTool"),
    ("tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n    tool_schema: {}",
     r"tools\[0\] .* has no tool_schema.function.name"),
    ("tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n    config: {}\n"
     "    tool_schema: {function: {name: c}}", "config.sandbox_fusion_url is required"),
    ("tools:\n  - class_name: 'no_such_module:Tool'\n    tool_schema: {function: {name: c}}", "cannot be imported"),
    ("tools: [", "is not valid YAML"),
])
def test_a_bad_tool_yaml_is_refused_naming_the_key(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_tools(write_yaml(tmp_path, body))
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    with pytest.raises(ConfigError, match="is not a file"):
        load_tools(str(tmp_path / "missing.yaml"))


def scheduler(tok, engine, tools, prompts=3, n=2):
    done = []
    recs = [PromptRecord(i, prompt_ids(tok), "calc", "3") for i in range(prompts)]
    stream = PromptStream(recs, shuffle=False, seed=0, total_epochs=1)
    sched = RolloutScheduler(engine, stream, StalenessManager(prompts, 1, 0.0, 1), n,
                             SamplingParams(1.0, 1.0, -1, 400), 100, True, on_complete=done.extend, tools=tools)
    return sched, done


def test_the_scheduler_runs_tools_beside_generation_and_parks_them_at_an_update(tok, tmp_path):
    """An update while tools run: park() waits for their answers and parks those responses with the rest; the
    snapshot survives the JSON round trip; resumed on the new weights every response ends as an uninterrupted
    one, its generated tokens stamped with the version that wrote them."""
    script = [call("1+2"), "The answer is 3."]
    ref_sched, ref_done = scheduler(tok, ToolCallingEngine(tok, script), loop(tok))
    ref_sched.admit()
    ref_sched.drain()
    engine = ToolCallingEngine(tok, script)
    sched, done = scheduler(tok, engine, ToolLoop(MultiTurnConfig(enable=True), [_calc(delay_s=0.3)], tok))
    sched.admit()
    while not sched.tooling:
        sched.step()
    assert sched.in_flight() >= len(sched.tooling) > 0
    sched.park()
    assert not sched.tooling and not engine.num_in_flight() and len(sched.parked) == 6
    write_state(str(tmp_path / "state.json"), sched.state_dict())
    restored, done2 = scheduler(tok, ToolCallingEngine(tok, script), loop(tok))
    restored.load_state_dict(read_state(str(tmp_path / "state.json")))
    restored.engine.update_weights({}, 1)
    restored.resume()
    restored.drain()
    got = {s.sample_id: s for g in done + done2 for s in g.samples}
    want = {s.sample_id: s for g in ref_done for s in g.samples}
    assert sorted(got) == sorted(want) and len(got) == 6
    for sid, s in got.items():
        assert s.response_ids == want[sid].response_ids and s.response_mask == want[sid].response_mask
        generated = [v for v, m in zip(s.versions, s.response_mask) if m]
        assert generated[0] == 0 and generated[-1] == 1 and generated == sorted(generated)


def test_rewards_see_the_whole_conversation_and_verls_num_turns(tok):
    p = pend(tok)
    loop(tok).drive(ToolCallingEngine(tok, [call("1+2"), "so \\boxed{3}"]), [p])
    seen = {}

    class Reward:
        def score(self, data_source, text, ground_truth, extra_info, length, sample=""):
            seen.update(text=text, extra=extra_info, length=length)
            return 1.0, {}

    s = p.to_sample()
    score_samples(tok, Reward(), PromptRecord(0, [], "calc", "3", extra_info={"split": "train"}), [s])
    assert "<tool_response>\n3\n</tool_response>" in seen["text"] and seen["text"].endswith("so \\boxed{3}")
    assert seen["extra"] == {"split": "train", "num_turns": 4} and seen["length"] == len(s.response_ids)


def test_validation_and_the_sync_loop_run_the_tools_too(tok):
    from fully_async.rollout.generation import run_to_completion

    pends = group_pendings("g", PromptRecord(0, prompt_ids(tok), "calc", "3"), 2, SamplingParams(0.0, 1.0, -1, 400))
    run_to_completion(ToolCallingEngine(tok, [call("2+2"), "4"]), pends, loop(tok))
    assert all(p.user_turns == 1 and "<tool_response>\n4\n" in tok.decode(p.token_ids) for p in pends)


def test_the_batch_masks_the_tool_answers_out_of_the_loss(tok):
    import torch

    from fully_async.core.batch import build_batch

    p = pend(tok)
    loop(tok).drive(ToolCallingEngine(tok, [call("1+2"), "3"]), [p])
    s = p.to_sample()
    batch = build_batch([s])
    resp = batch.response_mask[0, len(s.prompt_ids):len(s.prompt_ids) + len(s.response_ids)]
    assert resp.tolist() == [float(m) for m in s.response_mask]
    assert batch.response_mask[0, :len(s.prompt_ids)].sum() == 0
    assert torch.equal(batch.rollout_log_probs[0] * (1 - batch.response_mask[0]),
                       torch.zeros_like(batch.rollout_log_probs[0]))


def test_config_checks(monkeypatch, caplog):
    import logging

    from fully_async.core.config_checks import validate
    from fully_async.run.hydra_setup import load_config

    key = "actor_rollout_ref.rollout.multi_turn"
    for override, message in ((f"{key}.format=gpt-oss", r"format.*'gpt-oss' is not one of \['hermes'\]"),
                              (f"{key}.tool_response_truncate_side=top", "truncate_side"),
                              (f"{key}.max_parallel_calls=0", "max_parallel_calls"),
                              (f"{key}.max_assistant_turns=0", "max_assistant_turns")):
        with pytest.raises(ConfigError, match=message):
            validate(load_config([f"{key}.enable=true", override]))
    with caplog.at_level(logging.WARNING):
        validate(load_config([f"{key}.enable=true"]))
    assert "without tool_config_path: no tools are offered" in caplog.text


def test_prepare_refuses_a_dead_sandbox_and_a_tokenizer_without_a_chat_template(tmp_path, tok):
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.prepare import check_multi_turn

    path = write_yaml(tmp_path, """
        tools:
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {sandbox_fusion_url: "http://127.0.0.1:9/run_code"}
            tool_schema: {type: function, function: {name: code_interpreter}}
        """)
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"])
    with pytest.raises(ConfigError, match="SandboxFusion service at http://127.0.0.1:9/run_code did not run"):
        check_multi_turn(cfg, tok)
    with pytest.raises(ConfigError, match="has no chat template"):
        check_multi_turn(cfg, SimpleNamespace(chat_template=None))
    box = Sandbox()
    try:
        cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path = write_yaml(
            tmp_path, open(path).read().replace("http://127.0.0.1:9/run_code", box.url))
        assert check_multi_turn(cfg, tok) == [{"type": "function", "function": {"name": "code_interpreter"}}]
    finally:
        box.close()


def test_the_prompts_offer_the_tools_as_verls_agent_loop_renders_them(tmp_path, tok):
    import pandas as pd

    from fully_async.run.hydra_setup import load_config
    from fully_async.run.prepare import load_datasets

    pd.DataFrame([{"prompt": [{"role": "user", "content": "what is 1+2?"}], "data_source": "calc",
                   "reward_model": {"ground_truth": "3"}}]).to_parquet(tmp_path / "d.parquet")
    path = write_yaml(tmp_path, f"""
        tools:
          - class_name: "test_tools:Calc"
            tool_schema: {json.dumps(CALC)}
        """)
    base = [f"data.train_files={tmp_path}/d.parquet", "data.val_files=null", "data.max_prompt_length=512"]
    (plain,), _ = load_datasets(load_config(base), tok)
    (rec,), _ = load_datasets(load_config(base + ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                                  f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"]),
                              tok)
    assert rec.prompt_ids == prompt_ids(tok)            # apply_chat_template(messages, tools=[schemas])
    assert "<tools>" in tok.decode(rec.prompt_ids) and "<tools>" not in tok.decode(plain.prompt_ids)
