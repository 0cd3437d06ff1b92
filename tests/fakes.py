"""Test doubles importable by Ray workers (tests/ is put on PYTHONPATH by the tests that use them)."""
import time

from fully_async.rollout.engines.hf_engine import HFEngine


class HangingEngine(HFEngine):
    """Generates normally for a few steps, then never returns from collect() (a wedged engine)."""

    def collect(self, timeout_s: float = 0.05):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls > 3:
            time.sleep(3600)
        return super().collect(timeout_s)


class SecondReplicaCrashes(HFEngine):
    """In an engine pool, replica 1 (sampling seed = trainer.seed + 1) raises after a few engine steps."""

    def __init__(self, *args, seed: int = 1, **kwargs):
        super().__init__(*args, seed=seed, **kwargs)
        self._crash = seed == 2  # trainer.seed defaults to 1

    def collect(self, timeout_s: float = 0.05):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._crash and self._calls > 5:
            raise RuntimeError("replica exploded on purpose")
        return super().collect(timeout_s)


class ToolScriptEngine(HFEngine):
    """A policy that uses a calculator (multi-turn tool rollouts end to end): asked "what is A+B?", its first turn
    calls the `calc` tool in hermes format, its next turn answers \\boxed{<the tool's answer>}; one token per
    collect(), so weight updates cut turns and tool steps mid-way.  The weights still load (HFEngine's), the log-probs
    are -1.0."""

    def __init__(self, *args, **kwargs):
        import collections

        from transformers import AutoTokenizer

        super().__init__(*args, **kwargs)
        self.tok = AutoTokenizer.from_pretrained(args[0])
        self._queue, self._running = collections.deque(), {}

    def submit(self, requests):
        self._queue.extend(requests)

    def num_in_flight(self):
        return len(self._queue) + len(self._running)

    def collect(self, timeout_s: float = 0.05):
        import re

        from fully_async.core.types import GenOutput

        while self._queue:
            r = self._queue.popleft()
            context = self.tok.decode(r.prompt_ids)
            answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)
            if answers:
                text = f"so \\boxed{{{answers[-1]}}}"
            else:
                a, b = re.findall(r"what is (\d+)\+(\d+)\?", context)[-1]
                text = '<tool_call>{"name": "calc", "arguments": {"expr": "%s+%s"}}</tool_call>' % (a, b)
            turn = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            done_so_far = len(r.prompt_ids) - len(self.tok.encode(context[:context.rindex(
                "<|im_start|>assistant\n") + len("<|im_start|>assistant\n")], add_special_tokens=False))
            self._running[r.request_id] = (r, turn[done_so_far:], [])
        out = []
        for rid, (r, todo, toks) in list(self._running.items()):
            toks.append(todo[len(toks)])
            if len(toks) == len(todo) or len(toks) >= r.params.max_tokens:
                del self._running[rid]
                out.append(GenOutput(rid, toks, [-1.0] * len(toks), [self.version] * len(toks),
                                     "stop" if len(toks) == len(todo) else "length"))
        return out

    def interrupt(self):
        from fully_async.core.types import GenOutput

        out = [GenOutput(rid, toks, [-1.0] * len(toks), [self.version] * len(toks), "abort")
               for rid, (_, _, toks) in self._running.items()]
        out += [GenOutput(r.request_id, [], [], [], "abort") for r in self._queue]
        self._running.clear()
        self._queue.clear()
        return out


class CalcTool:
    """A user tool for multi-turn runs ("fakes:CalcTool"): evaluates "A+B"."""

    def __init__(self, config, tool_schema):
        self.config = config

    def execute(self, arguments):
        a, b = arguments["expr"].split("+")
        return str(int(a) + int(b))


def calc_reward(data_source, solution_str, ground_truth, extra_info):
    """1 for the right \\boxed answer reached through one tool call (verl's num_turns: prompt + 2 turns + 1 answer)."""
    return float(f"\\boxed{{{ground_truth}}}" in solution_str and extra_info["num_turns"] == 4)
