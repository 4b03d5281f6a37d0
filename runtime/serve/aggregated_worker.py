"""The aggregated worker of `unweight serve --no-disagg`: prefill and decode in one process, the
baseline disaggregation is measured against."""

from __future__ import annotations

import torch

from ..model.sampling import Sequence
from .batch import BatchWorker, Slot
from .worker_base import _job_error, _prompt_key, lp_item


class AggregatedWorker(BatchWorker):
    """Both phases in one process (--no-disagg): a waiting prompt is prefilled in the same forward as
    the running batch's next step (its rows ride on the prompt's matmuls, as in vLLM's chunked
    prefill), though every running sequence still waits for the whole prompt: the baseline
    disaggregation is measured against."""

    ROLE, JOB = "worker", "generate"

    def step(self) -> None:
        self.poll(0 if (self.running or self.waiting or self.preempted) else 50)
        self._resume_preempted()
        self._make_room()
        if (
            self.waiting
            and not self.preempted
            and len(self.running) < self.max_batch
            and self._fits(len(self.waiting[0]["seq"]["prompt"]))
        ):
            job = self.waiting.popleft()  # the whole prompt now: every running sequence waits for it
            if (
                self.running
                and job.get("prompt_logprobs") is None
                and self.model.graph_decoder is None
                and not self.repeats_shared(_prompt_key(job))  # a copy beats riding along
            ):
                self._prefill_with_step(job)
                return
            done = self._first_token(job)
            if done is not None and done[3] is None:
                cache, seq, pick, _ = done
                self.emit([[job["id"], pick.token, None, lp_item(pick)]])
                self.running[job["id"]] = Slot(job["id"], cache, seq)
        if self.running:
            self._step()

    def _prefill_with_step(self, job: dict) -> None:
        """A job's prompt and the running batch's next step in one forward (CausalLM.prefill_with_step):
        the job's first token, then the batch's tokens. Should the forward fail, the job fails alone
        and the batch takes its step on its own."""
        if self.cores is not None:
            self.cores.step()
        slots = list(self.running.values())
        seq = Sequence.from_state(job["seq"], self.model.config.vocab_size)
        cache = self.model.new_sequence()
        try:
            first, logits = self.model.prefill_with_step(
                cache,
                torch.tensor(seq.prompt, dtype=torch.int64),
                [s.cache for s in slots],
                [s.seq.output[-1] for s in slots],
            )
        except Exception as e:  # noqa: BLE001 - a job that cannot run fails alone; the batch steps alone
            self.model.free(cache)
            self.fail(job["id"], _job_error(e))
            self._step()
            return
        try:
            pick = seq.choose(first)
        except Exception as e:  # noqa: BLE001 - never expected (sampling is total); the batch has its step
            self.model.free(cache)
            self.fail(job["id"], _job_error(e))
        else:
            self._share(job["id"], _prompt_key(job), cache, first, None)
            self.prompt_tokens += len(seq.prompt)
            reason = seq.append(pick.token)
            stop = reason == "stop"
            self.emit([[job["id"], None if stop else pick.token, reason, None if stop else lp_item(pick)]])
            if reason is None:
                self.running[job["id"]] = Slot(job["id"], cache, seq)
            else:
                self.model.free(cache)
        self._stepped(slots, logits)
