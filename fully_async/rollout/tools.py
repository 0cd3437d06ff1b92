"""Multi-turn tool rollouts (layer 5): verl's tool agent loop (actor_rollout_ref.rollout.multi_turn.*).

A response is a conversation: the policy writes an assistant turn (ended by EOS, the chat template's end of turn);
if that turn calls tools in hermes format -- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
the first `max_parallel_calls` run -- the tools' answers are appended as chat-template `tool` messages with the next
assistant header (`apply_chat_template(messages, add_generation_prompt=True)` less the template's default system
prompt, as verl's `remove_system_prompt`), and the policy continues from there.  The appended tokens are outside the
loss (`PendingResponse.observe`: mask 0, log-prob 0).  It ends, as verl's ToolAgentLoop: at a turn that calls no
tool, at the response budget (data.max_response_length: a tool answer that would reach it is not appended),
after max_assistant_turns turns or max_user_turns answers.  A tool that fails answers "Error when executing tool:
<why>"; an answer longer than max_tool_response_length characters is cut as verl cuts it.

Tools come from verl's tool YAML (`tool_config_path`): `tools: [{class_name, config, tool_schema}]`.  verl's
`SandboxFusionTool` (and retool's `CustomSandboxFusionTool`, which also strips a ```python fence and prints the
last expression) run `arguments.code` in a SandboxFusion service (rewards/sandbox_fusion.call_api) and answer its
stdout + stderr ("no stdout here" when the run did not finish, as verl).  Any other tool is a class of your own,
`package.module:Class`, built with (config: dict, tool_schema: dict) and answering `execute(arguments: dict) -> str`.

Tools run in a thread pool while the engine keeps generating the other responses (`ToolLoop.start` returns a
future); `ToolLoop.drive` runs a set of responses to the end for the sync loop and validation, and the rollout
scheduler folds the same steps into its own loop.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from fully_async.core.config import ConfigError
from fully_async.core.partial import PendingResponse

logger = logging.getLogger(__name__)

KEY = "actor_rollout_ref.rollout.multi_turn"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
SANDBOX_TOOLS = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": False,
                 "recipe.retool.retool.CustomSandboxFusionTool": True}   # class name -> retool's code rewrite
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class ToolCall:
    name: str
    arguments: Any     # the parsed "arguments" (a dict for well-formed calls)


def parse_hermes(text: str) -> list[ToolCall]:
    """verl's HermesToolParser: every <tool_call>...</tool_call> whose body is JSON with "name" and "arguments";
    malformed ones are skipped."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return []
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append(ToolCall(call["name"], call["arguments"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.debug("a malformed tool call is skipped: %s", exc)
    return calls


def truncate(text: str, limit: int, side: str) -> str:
    """verl's cut of a long tool answer: left keeps the head, right the tail, middle both halves."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class SandboxCodeTool:
    """verl's SandboxFusionTool: runs `arguments["code"]` in a SandboxFusion service."""

    def __init__(self, config: dict, tool_schema: dict, retool: bool = False):
        self.schema = tool_schema
        self.name = tool_schema["function"]["name"]
        self.url = config.get("sandbox_fusion_url")
        if not self.url:
            raise ConfigError(f"{KEY}.tool_config_path", f"tool {self.name!r}: config.sandbox_fusion_url is required "
                                                         "(the SandboxFusion run_code URL)")
        self.timeout = int(config.get("default_timeout", 30))
        self.language = str(config.get("default_language", "python"))
        self.memory_limit_mb = int(config.get("memory_limit_mb", 1024))
        self.retool = retool
        # verl runs these calls in an actor of num_workers threads under a job-wide bucket of rate_limit at once;
        # here one process calls: at most that many at a time
        limit = int(config.get("num_workers", 10))
        if config.get("enable_global_rate_limit", True):
            limit = min(limit, int(config.get("rate_limit", 10)))
        self.max_concurrent = max(1, limit)

    def execute(self, arguments: dict) -> str:
        from fully_async.rewards.sandbox_fusion import call_api, semaphore

        code = arguments.get("code", "")
        code = code if isinstance(code, str) else str(code)
        if self.retool:
            code = retool_code(code)
        with semaphore(self.url, self.max_concurrent):
            answer, error = call_api(self.url, code, None, int(arguments.get("timeout", self.timeout)),
                                     self.memory_limit_mb, str(arguments.get("language", self.language)))
        run = (answer or {}).get("run_result") or {}
        if run.get("status") == "Finished":
            return (run.get("stdout") or "") + (run.get("stderr") or "")
        if error is not None:
            logger.warning("tool %s: the sandbox did not answer: %s", self.name, error)
        return "no stdout here"


def retool_code(code: str) -> str:
    """retool's CustomSandboxFusionTool rewrite: the body of a ```python block if there is one, and its last
    non-empty line printed unless it already prints."""
    fenced = re.findall(r"```python(.*?)```", code, re.DOTALL)
    if fenced:
        code = fenced[0].strip()
    lines = code.split("\n")
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] == "":
            continue
        if not lines[i].startswith("print"):
            lines[i] = f"print({lines[i]})"
        break
    return "\n".join(lines)


def load_tools(path: str) -> list[Any]:
    """The tools of verl's tool YAML at `path`, built (nothing is called); ConfigError naming the key otherwise."""
    import yaml

    key = f"{KEY}.tool_config_path"
    if not os.path.isfile(path):
        raise ConfigError(key, f"{path} is not a file")
    try:
        with open(path) as f:
            spec = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{path} is not valid YAML: {exc}") from None
    entries = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(key, f"{path} has no `tools:` list (verl's format: tools: [{{class_name, config, "
                               "tool_schema}}])")
    tools = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(key, f"{path}: tools[{i}] has no class_name")
        schema = entry.get("tool_schema")
        if not (isinstance(schema, dict) and isinstance(schema.get("function"), dict)
                and schema["function"].get("name")):
            raise ConfigError(key, f"{path}: tools[{i}] ({entry['class_name']}) has no tool_schema.function.name")
        tools.append(_build_tool(key, path, entry["class_name"], dict(entry.get("config") or {}), schema))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ConfigError(key, f"{path}: tool names repeat: {names}")
    return tools


def _build_tool(key: str, path: str, class_name: str, config: dict, schema: dict) -> Any:
    if class_name in SANDBOX_TOOLS:
        return SandboxCodeTool(config, schema, retool=SANDBOX_TOOLS[class_name])
    if ":" not in class_name:
        raise ConfigError(key, f"{path}: tool class {class_name!r} is not one this package runs: verl's "
                               f"{', '.join(SANDBOX_TOOLS)}, or a class of your own as 'package.module:Class' "
                               "(built with (config, tool_schema); execute(arguments: dict) -> str)")
    module, _, name = class_name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(key, f"{path}: tool class {class_name!r} cannot be imported: {exc}") from None
    tool = cls(config, schema)
    if not callable(getattr(tool, "execute", None)):
        raise ConfigError(key, f"{path}: tool class {class_name!r} has no execute(arguments) method")
    tool.name, tool.schema = schema["function"]["name"], schema
    return tool


def default_system_prompt(tokenizer: Any, template_kwargs: dict) -> list[int]:
    """The tokens a chat template puts before the first message by itself (verl's initialize_system_prompt)."""
    one = _template_ids(tokenizer, [{"role": "user", "content": ""}], False, template_kwargs)
    two = _template_ids(tokenizer, [{"role": "user", "content": ""}] * 2, False, template_kwargs)
    return one[:len(one) - (len(two) - len(one))]


def _template_ids(tokenizer: Any, messages: list[dict], generation_prompt: bool, template_kwargs: dict) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False, **template_kwargs))


class ToolLoop:
    """The tool steps between a response's assistant turns (module docstring)."""

    def __init__(self, mt: Any, tools: Sequence[Any], tokenizer: Any, template_kwargs: Optional[dict] = None,
                 workers: int = 32):
        self.mt = mt
        self.tools = {t.name: t for t in tools}
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.system_prompt = default_system_prompt(tokenizer, self.template_kwargs)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any) -> Optional["ToolLoop"]:
        mt = cfg.actor_rollout_ref.rollout.multi_turn
        if not mt.enable:
            return None
        tools = load_tools(mt.tool_config_path) if mt.tool_config_path else []
        return cls(mt, tools, tokenizer, dict(cfg.data.apply_chat_template_kwargs or {}))

    def calls_after_turn(self, pend: PendingResponse) -> list[ToolCall]:
        """A generation turn of `pend` just ended: the tool calls to run before its next turn, or [] when the
        response ends here."""
        pend.assistant_turns += 1
        mt = self.mt
        if pend.finish_reason == "length" or len(pend.token_ids) >= pend.budget:
            return []
        if mt.max_assistant_turns and pend.assistant_turns >= mt.max_assistant_turns:
            return []
        if mt.max_user_turns and pend.user_turns >= mt.max_user_turns:
            return []
        text = self.tokenizer.decode(pend.token_ids[pend.turn_start:])
        return parse_hermes(text)[:mt.max_parallel_calls]

    def start(self, pend: PendingResponse, calls: list[ToolCall]) -> concurrent.futures.Future:
        """Run `calls` in the pool; the future's result is the tokens to append, or None when they would reach
        the response budget (the response then ends)."""
        room = pend.budget - len(pend.token_ids)
        return self.pool.submit(self._answer, calls, room)

    def _answer(self, calls: list[ToolCall], room: int) -> Optional[list[int]]:
        messages = [{"role": "tool", "content": self._run(call)} for call in calls]
        ids = _template_ids(self.tokenizer, messages, True, self.template_kwargs)
        if ids[:len(self.system_prompt)] == self.system_prompt:
            ids = ids[len(self.system_prompt):]
        return None if len(ids) >= room else ids

    def _run(self, call: ToolCall) -> str:
        try:
            tool = self.tools[call.name]
            arguments = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
            text = tool.execute(arguments)
        except Exception as exc:  # noqa: BLE001 - the model sees the failure, as in verl
            logger.debug("tool %r failed: %s", call.name, exc)
            text = f"Error when executing tool: {exc}"
        text = "" if text is None else str(text)
        return truncate(text, self.mt.max_tool_response_length, self.mt.tool_response_truncate_side)

    @staticmethod
    def apply(pend: PendingResponse, ids: Optional[list[int]]) -> bool:
        """Fold a tool step's result into `pend`; True when it continues (resubmit `pend.request()`)."""
        if ids is None:
            return False
        pend.observe(ids)
        return True

    def after_turn(self, pend: PendingResponse, tooling: dict) -> bool:
        """After one of `pend`'s turns: its tool calls started, in `tooling` (sample_id -> (response, future));
        False when it made none (the response has ended)."""
        calls = self.calls_after_turn(pend)
        if calls:
            tooling[pend.sample_id] = (pend, self.start(pend, calls))
        return bool(calls)

    def settle(self, tooling: dict) -> tuple[list[PendingResponse], list[PendingResponse]]:
        """The responses in `tooling` whose tools answered, taken out with the answers applied: (those that
        continue, those that ended)."""
        resubmit, ended = [], []
        for sid in [sid for sid, (_, future) in tooling.items() if future.done()]:
            pend, future = tooling.pop(sid)
            (resubmit if self.apply(pend, future.result()) else ended).append(pend)
        return resubmit, ended

    def drive(self, engine: Any, pendings: Sequence[PendingResponse]) -> None:
        """Generate every response to its end, tool steps included (the engine must hold nothing else)."""
        by_id = {p.sample_id: p for p in pendings}
        tooling: dict = {}
        engine.submit([p.request() for p in pendings])
        while engine.num_in_flight() or tooling:
            for out in engine.collect():
                pend = by_id[out.request_id]
                if pend.extend(out):
                    self.after_turn(pend, tooling)
            if tooling and not engine.num_in_flight():   # nothing to generate: wait for a tool
                concurrent.futures.wait([f for _, f in tooling.values()],
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            resubmit, _ = self.settle(tooling)
            if resubmit:
                engine.submit([p.request() for p in resubmit])
