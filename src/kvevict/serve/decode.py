"""The decoder: prefills admitted requests, steps every running batch by one token, streams each
row's text and ends rows (EOS, max_tokens, stop string, client gone, deadline passed). Rows that
end leave their batch at once and its storage is freed; a batch that fails fails alone."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from ..storage import Pools
from .batch import DecodeBatch
from .budgeter import Budgeter
from .handle import Handle, Row, Running, joins, scores_prompt
from .logprobs import prompt_entries, token_entries
from .metrics import Metrics
from .prefix_fill import PrefixFill
from .sampling import pick_tokens
from .settings import Settings


class Decoder:
    """Runs on the engine's worker thread; ``freed`` is called when rows left (memory for waiting
    requests), ``loops`` says which worker loop this is (how soon a cancelled row left)."""

    def __init__(
        self,
        model,
        tokenizer,
        settings: Settings,
        budgeter: Budgeter,
        pages: Pools,
        metrics: Metrics,
        log: deque,
        running: list[Running],
        freed: Callable[[], None],
        loops: Callable[[], int],
        prefixes: PrefixFill | None = None,
    ):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.budgeter, self.pages, self.metrics, self.log = budgeter, pages, metrics, log
        self.running = running  # the engine's running batches (the same list)
        self.freed, self.loops = freed, loops
        self.prefixes = prefixes  # the prefix store's prefill (None: the store is off)
        self.eos_ids = eos_ids(model, tokenizer)

    def start(self, handles: list[Handle]) -> None:
        """Prefill admitted requests of one group together, stream each one's first token, and join
        the first running batch that can take them (any policy and budget; full-cache rows among
        themselves). A request that reuses or stores a prompt prefix (``prefix_fill``) is
        prefilled alone."""
        now = time.monotonic()
        running = sum(len(run.rows) for run in self.running)
        for i, h in enumerate(handles):  # running: the sequences decoding beside it once it starts
            self.log.append(
                {
                    "event": "admit",
                    "id": h.req.id,
                    "t": now,
                    "waited": now - h.submitted,
                    "running": running + i,
                    "prefill": len(handles),
                }
            )
        plain = []
        for h in handles:
            plan = None if self.prefixes is None else self.prefixes.plan(h)
            if plan is None:
                plain.append(h)
            else:
                self._begin([h], self.prefixes.prefill, h, *plan)
        if plain:
            self._begin(plain, self._prefill, plain)

    def _prefill(self, handles: list[Handle]):
        """Prompts of one policy and budget in one forward: (their batch, each one's last logits)."""
        req = handles[0].req
        scores = scores_prompt(req)
        batch, logits = DecodeBatch.prefill_many(
            self.model,
            [h.req.prompt_ids for h in handles],
            req.policy,
            req.budget_tokens,
            req.recent,
            self.settings.kv_bits,
            self.pages,
            all_logits=scores,
        )
        if scores:  # echo + logprobs: the prompt's own, from the prefill's logits at every position
            for i, h in enumerate(handles):
                h.push(("prompt", prompt_entries(logits[i], h.req.prompt_ids, h.req.logprobs)))
            logits = logits[:, -1]
        return batch, logits

    def _begin(self, handles: list[Handle], prefill, *args) -> None:
        """``prefill(*args)`` gives the requests' batch and last logits: stream each one's first
        token and join a running batch."""
        rows = [Row(h, self.tokenizer) for h in handles]
        try:
            batch, logits = prefill(*args)
        except Exception as err:  # these requests fail alone; the running batches go on
            self._fail(rows, err)
            return
        for h in handles:
            self.metrics.observe("kvevict_time_to_first_token_seconds", time.monotonic() - h.submitted)
        ended = self._advance(rows, logits)
        if ended:  # some ended at their first token
            keep = [i for i in range(len(rows)) if i not in ended]
            if not keep:
                return
            batch.keep(keep)
            rows = [rows[i] for i in keep]
        spec = rows[0].handle.spec
        for run in self.running:
            if joins([r.handle.spec for r in run.rows], spec) and run.batch.can_join(batch):
                run.batch.join(batch)
                run.rows += rows
                for r in rows:
                    self._log_join(r.req, run)
                return
        self.running.append(Running(batch, rows))
        for r in rows:
            self._log_join(r.req, self.running[-1])

    def _log_join(self, req, run: Running) -> None:
        self.log.append(
            {
                "event": "join",
                "id": req.id,
                "size": len(run.rows),
                "batch": id(run),
                "ids": [r.req.id for r in run.rows],
                "t": time.monotonic(),
            }
        )

    def step_all(self) -> None:
        # a method, not a loop in the worker's loop: a loop variable there would keep the last batch
        # that ended (and its pages) alive while the worker waits idle for the next request
        for run in list(self.running):
            self._step(run)

    def _step(self, run: Running) -> None:
        now = time.monotonic()
        gone = [i for i, r in enumerate(run.rows) if r.handle.cancelled.is_set() or r.handle.expired(now)]
        for i in gone:
            self._finish(run.rows[i], "cancelled" if run.rows[i].handle.cancelled.is_set() else "timeout")
        if gone:
            self._keep(run, [i for i in range(len(run.rows)) if i not in gone])
            if not run.rows:
                return
        try:
            logits = run.batch.step([r.pending for r in run.rows])
        except Exception as err:  # a failure ends this batch, never the server
            self.running.remove(run)
            self._fail(run.rows, err)
            return
        for r in run.rows:
            r.fed += 1
        ended = self._advance(run.rows, logits)
        if ended:
            self._keep(run, [i for i in range(len(run.rows)) if i not in ended])

    def _advance(self, rows: list[Row], logits) -> set[int]:
        """Pick each row's next token (fed at the next step), stream its text; finish the rows that
        end and return their indices."""
        tokens = pick_tokens(logits, [(r.req.temperature, r.req.top_p, r.generator) for r in rows])
        self.metrics.add("kvevict_generated_tokens_total", len(rows))
        want = [i for i, r in enumerate(rows) if r.req.logprobs is not None]
        if want:  # from the logits the step already has: one log_softmax for the rows that ask
            index = torch.tensor(want, device=logits.device)
            for i, e in zip(
                want, token_entries(logits[index], [tokens[i] for i in want], [rows[i].req.logprobs for i in want])
            ):
                rows[i].entries.append(e)
        ended = set()
        for i, (r, tok) in enumerate(zip(rows, tokens)):
            r.generated += 1
            r.pending = tok
            reason = None
            if tok in self.eos_ids and not r.req.ignore_eos:
                reason = "stop"  # the EOS token counts as generated but is not text
            else:
                delta = r.text.add(tok)
                if delta:
                    self._send(r, delta)
                if r.text.stopped:
                    reason = "stop"
                elif r.generated >= r.req.max_tokens:
                    reason = "length"
            if reason:
                self._finish(r, reason)
                ended.add(i)
        return ended

    def _send(self, r: Row, text: str) -> None:
        """A text delta with the logprob entries of the tokens it completes."""
        r.handle.push(("delta", text, r.entries))
        r.entries = []

    def _keep(self, run: Running, keep: list[int]) -> None:
        before, size = run.batch.kv_bytes(), len(run.rows)
        run.rows = [run.rows[i] for i in keep]
        if not run.rows:
            self.running.remove(run)  # the batch and its cache are dropped whole
            after = 0
        else:
            run.batch.keep(keep)
            after = run.batch.kv_bytes()
        self.log.append(
            {
                "event": "shrink",
                "ids": [r.req.id for r in run.rows],
                "size_before": size,
                "size": len(run.rows),
                "kv_bytes_before": before,
                "kv_bytes": after,
            }
        )
        self.freed()  # memory was freed: the next admission sees it

    def _finish(self, r: Row, reason: str) -> None:
        """A sequence ends: tell its client how, and what its cache held."""
        req, prompt = r.req, len(r.req.prompt_ids)
        entry = {"event": "finish", "id": req.id, "reason": reason, "generated": r.generated, "t": time.monotonic()}
        if r.handle.cancel_loop is not None:
            entry["loops_after_cancel"] = self.loops() - r.handle.cancel_loop
        self.log.append(entry)
        self.metrics.add("kvevict_prompt_tokens_total", prompt)
        budget = req.budget_tokens
        evicted = 0 if budget is None else max(0, r.fed - budget)
        self.metrics.add("kvevict_evicted_tokens_total", evicted * self.budgeter.entries_per_token)
        if reason == "cancelled":
            self.metrics.add("kvevict_requests_total", outcome="cancelled")
            return
        if reason == "timeout":
            self.metrics.add("kvevict_requests_total", outcome="timeout")
            r.handle.push_timeout()
            return
        tail = r.text.flush()
        if tail or r.entries:  # held-back text, and the logprobs of tokens with no text (EOS)
            self._send(r, tail)
        held = self.budgeter.row_bytes(req.policy, budget, req.recent, r.fed)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": r.generated,
            "total_tokens": prompt + r.generated,
            "kv_policy": req.policy,
            "kv_budget": req.budget,
            "kv_budget_tokens": budget,
            "kv_bytes": held,
            "kv_bytes_full": self.budgeter.stock_bytes(r.fed),
            "kv_evicted_tokens": evicted,
        }
        self.metrics.add("kvevict_requests_total", outcome="completed")
        r.handle.push(("finish", reason, usage))

    def _fail(self, rows: list[Row], err: Exception) -> None:
        msg = f"generation failed: {type(err).__name__}: {err}"
        for r in rows:
            r.handle.push(("error", msg, 500))
        self.metrics.add("kvevict_requests_total", len(rows), outcome="failed")
        self.log.append({"event": "failed", "ids": [r.req.id for r in rows], "error": msg})


def eos_ids(model, tokenizer) -> set[int]:
    """Every token id that ends a sequence: the generation config's, the model config's, the tokenizer's."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(source, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
