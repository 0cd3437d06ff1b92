"""The embedded engine's admission: which waiting requests join at a step and how they are prefilled into their slots
(HFEngine's mixin; hf_engine.py holds the cache, the decode step and the loop).

Joiners.  At most `rollout.max_num_batched_tokens` tokens a step (verl's 8192, as vLLM bounds its steps); the oldest
waiting request always joins.
- Packed prefill (where a fused varlen attention kernel runs and the decode step is the fused one: CUDA with
  FlashAttention's kernel or an Ascend NPU with torch_npu's, 16-bit, llama-family models): the joiners' tokens back
  to back through the fused layer functions (`FusedDecoder.prefill`), no padding; the budget counts real tokens, first come first served.  A request longer than the budget is split
  over steps (`rollout.enable_chunked_prefill`, verl's default, as vLLM does): each step prefills the next chunk of
  at most the budget, attending over the positions its slot already holds, while the running sequences go on
  decoding; its slot is reserved meanwhile, and it joins the decode once its last chunk is in.
- Padded prefill (elsewhere): one transformers forward over the joiners right-padded to the longest; the budget
  counts padded tokens, and the joiners are picked to make the most real tokens at one width (`_joining`); a request
  longer than the budget is prefilled alone.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Any, Optional

import numpy as np
import torch

from fully_async.core.types import GenOutput, GenRequest


class EnginePrefill:
    """Admission and prefill of HFEngine (it provides the slots, the cache, the fused decoder and the state)."""

    def _want_packed_prefill(self, asked: Optional[bool]) -> bool:
        """The joiners' prompts prefilled back to back through the fused layer functions (no padding,
        FusedDecoder.prefill): by default where a fused varlen attention kernel runs (CUDA's FlashAttention or
        torch_npu's, 16-bit floats); elsewhere only when asked (attention then runs prompt by prompt: the unit tests);
        needs the fused decode forward."""
        from fully_async.core.varlen_attention import fused_varlen_runs, resolve_packed_kernel

        if self.torch_device.type == "cuda":
            resolve_packed_kernel(self.torch_device)   # the packed kernel decided before any layer is compiled
        if asked is False:
            return False
        if self._fused is None:
            if asked:
                raise ValueError("HFEngine(packed_prefill=True) needs the fused decode forward (fused_decode=True, "
                                 "a llama-family model, no fp8 emulation)")
            return False
        return bool(asked) or fused_varlen_runs(self.torch_device.type, self.lm_head.weight.dtype,
                                                self._fused.head_dim)

    def _admit(self) -> None:
        if self._chunk is not None:   # a long request's next chunk first: this step's budget is its
            self._continue_chunk()
            return
        free = np.flatnonzero(~self._occ)
        running = self.max_num_seqs - len(free)
        if not len(free) or not self.waiting or (running and len(free) < self.admit_batch):
            return
        joining = self._joining(len(free))
        slot_ids = free[:len(joining)]
        lens = [len(r.prompt_ids) for r in joining]
        cache, _ = self._buffers(max(n + r.params.max_tokens for n, r in zip(lens, joining)))
        budget = self.max_num_batched_tokens
        if self.packed_prefill and self.chunked_prefill and budget is not None and lens[0] > budget:
            self._start_chunk(joining[0], int(slot_ids[0]), cache)   # (a longer request always joins alone)
            return
        if self.packed_prefill:
            last = self._prefill_packed([r.prompt_ids for r in joining], slot_ids, lens, cache)
        else:
            last = self._prefill_padded(joining, slot_ids, lens, cache)
        self._seat(joining, slot_ids, lens, last)

    def _seat(self, joining: list[GenRequest], slot_ids: Any, lens: list[int], last: torch.Tensor) -> None:
        """The prefilled requests take their slots: pending logits from their last token's hidden state `last`, their
        lengths, sampling parameters and host record."""
        dev, state = self.torch_device, self._state
        slots = torch.as_tensor(np.asarray(slot_ids, dtype=np.int64), device=dev)
        state["logits"][slots] = self.lm_head(last).float()
        state["lengths"][slots] = torch.tensor(lens, dtype=torch.long, device=dev)
        params = [r.params for r in joining]
        state["temperature"][slots] = torch.tensor([p.temperature for p in params], device=dev)
        state["top_p"][slots] = torch.tensor([p.top_p for p in params], device=dev)
        state["top_k"][slots] = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        for i, r in zip(slot_ids, joining):
            self.slots[i] = r
        self._occ[slot_ids] = True
        self._len[slot_ids] = lens
        self._gen[slot_ids] = 0
        self._logit_ver[slot_ids] = self.version
        self._max[slot_ids] = [p.max_tokens for p in params]
        self._truncates[slot_ids] = [p.top_k > 0 or p.top_p < 1.0 for p in params]

    # ------------------------------------------------------------------ chunked prefill
    def _start_chunk(self, req: GenRequest, slot: int, cache: Any) -> None:
        """A request longer than the budget: its first chunk now, the rest at the next steps (_continue_chunk), which
        admit nothing else.  Its slot is not occupied for the decode (nothing samples or retires it) and `_compact`
        does not run meanwhile; a decode step over it (when running sequences lie above it) writes only at the
        position the next chunk writes first."""
        self._chunk = [slot, req, 0]
        self._continue_chunk(cache)

    def _continue_chunk(self, cache: Any = None) -> None:
        slot, req, done = self._chunk
        n, budget = len(req.prompt_ids), self.max_num_batched_tokens
        take = min(budget, n - done)
        cache = cache if cache is not None else self._cache
        last = self._prefill_packed([req.prompt_ids[done:done + take]], [slot], [take], cache, prefix=done)
        done += take
        if done < n:
            self._chunk[2] = done
            self._state["lengths"][slot] = done   # where a decode step over the slot writes: the next chunk's start
            return
        self._chunk = None
        self._seat([req], [slot], [n], last)

    def _requeue_chunk(self) -> None:
        """The request being prefilled in chunks goes back to the head of the waiting queue (a sleep that frees the
        cache keeps only the occupied slots' KV): it is prefilled again from its first chunk."""
        if self._chunk is not None:
            self.waiting.appendleft(self._chunk[1])
            self._chunk = None

    def _drop_chunk(self) -> list[GenOutput]:
        """The request being prefilled in chunks, stopped before it generated anything (interrupt, or a sleep: its
        cached chunks are not kept), as an aborted output with no tokens; [] when there is none."""
        if self._chunk is None:
            return []
        req = self._chunk[1]
        self._chunk = None
        return [GenOutput(req.request_id, [], [], [], "abort")]

    def _prefill_padded(self, joining: list[GenRequest], slot_ids: Any, lens: list[int], cache: Any) -> torch.Tensor:
        """transformers' forward over the joiners' prompts right-padded to the longest; the last real token's hidden
        state of each, (B, hidden).  Plain causal attention (no mask: SDPA's causal kernel, flash where the device
        has it): a real token at position p reads keys 0..p, all real; the padding's queries come after every real
        token, and what they write lies past the slot's length, where decode writes before anything reads."""
        dev, width = self.torch_device, max(lens)
        ids = torch.full((len(joining), width), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(joining):
            ids[i, :lens[i]] = torch.tensor(r.prompt_ids, dtype=torch.long)
        positions = torch.arange(width, device=dev).expand(len(joining), width)
        slots = torch.as_tensor(np.asarray(slot_ids, dtype=np.int64), device=dev)
        hidden = self.base(input_ids=ids.to(dev), position_ids=positions, attention_mask=None,
                           **{self._cache_kw: cache.prefill(slots, width)}, use_cache=True).last_hidden_state
        return hidden[torch.arange(len(joining), device=dev), torch.tensor(lens, device=dev) - 1]

    def _prefill_packed(self, prompts: list[list[int]], slot_ids: Any, lens: list[int], cache: Any,
                        prefix: int = 0) -> torch.Tensor:
        """The joiners' prompts back to back as one packed batch through the fused layer functions
        (FusedDecoder.prefill): no padding, matrix products over all their tokens at once, attention within each
        prompt; the last token's final hidden state of each, (B, hidden).  `prefix`: one prompt, a chunk of a longer
        request that continues after `prefix` positions its slot already holds (positions from there)."""
        dev = self.torch_device
        ids = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]))
        positions = torch.from_numpy(np.concatenate([np.arange(prefix, prefix + n, dtype=np.int64) for n in lens]))
        slots = torch.from_numpy(np.repeat(np.asarray(slot_ids, dtype=np.int64), lens))
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        while len(cache.keys) < len(self._fused.layers):   # the first prefill makes the cache's layers
            cache.add_layer(self._fused.kv_heads, self._fused.head_dim, self.lm_head.weight.dtype, dev)
        return self._fused.prefill(ids.to(dev), positions.to(dev), slots.to(dev), cu.to(dev), max(lens),
                                   cache.keys, cache.values, prefix=prefix)

    def _joining(self, free: int) -> list[GenRequest]:
        """The waiting requests that join at this step: as many as there are free slots and, with a budget, as fit
        in it as one prefill; a padded prefill (joiners x the longest of them).  Without a budget, or when the first `free`
        waiting requests fit it together, they join first come first served.  Otherwise the oldest joins, with the
        others among the next `free` waiting requests that make the most real tokens at one padded width: for
        each width (the oldest's length or a longer one of theirs), the longest of those no longer than it, as
        many as the budget holds at that width.  A burst of resumed partial responses (prompt + partial response
        each, from tens to thousands of tokens) then fills each prefill with tokens of similar length instead of
        padding short ones to the longest (up to half of a first-come step's tokens were padding).  No request
        waits past the ones ahead of it becoming the oldest: the oldest always joins.  A packed prefill has no
        padding: the requests join first come first served while their real tokens fit the budget (the oldest
        always, alone if it is longer)."""
        budget = self.max_num_batched_tokens
        window = list(itertools.islice(self.waiting, free))
        if budget is None or len(window) * max(len(r.prompt_ids) for r in window) <= budget:
            return [self.waiting.popleft() for _ in window]
        if self.packed_prefill:   # no padding: the budget counts real tokens, first come first served
            take, total = 0, 0
            for r in window:
                if take and total + len(r.prompt_ids) > budget:
                    break
                take, total = take + 1, total + len(r.prompt_ids)
            return [self.waiting.popleft() for _ in range(take)]
        head = window[0]
        first = len(head.prompt_ids)
        others = sorted(window[1:], key=lambda r: len(r.prompt_ids))          # shortest first
        lens = [len(r.prompt_ids) for r in others]
        best, best_width, best_take = -1, first, 0
        for width in sorted({first, *(n for n in lens if n > first)}):
            room = budget // width - 1
            if room < 0:
                break
            upto = bisect.bisect_right(lens, width)                          # others no longer than width
            take = min(room, upto)
            real = first + sum(lens[upto - take:upto])
            if real > best:
                best, best_width, best_take = real, width, take
        upto = bisect.bisect_right(lens, best_width)
        chosen = {id(r) for r in others[upto - best_take:upto]}
        joining = [head] + [r for r in window[1:] if id(r) in chosen]
        self.waiting.popleft()
        self.waiting = deque(r for r in self.waiting if id(r) not in chosen)
        return joining

