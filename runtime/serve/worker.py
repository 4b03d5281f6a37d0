"""Worker processes of `unweight serve`: PrefillWorker, DecodeWorker, or one AggregatedWorker.

The router starts each with `python -m unweight.runtime.serve.worker`, its WorkerSpec (the whole
ServeConfig, its role, name and the router's addresses) and the control secret in the
environment; a worker on another host is started with `unweight serve --role ...`, which builds
the same WorkerSpec. Each loads the compressed model itself, connects to the router's control
socket and runs its loop:
- prefill: one prompt at a time -> first token -> KV cache exported and sent to the decode worker
  the router chose (a compute-bound phase: large matmuls, the decode-then-matmul pipeline wins);
- decode: continuous batching. KV caches arriving from prefill workers join the running batch
  between steps, finished sequences leave it, one `decode_step` advances every sequence by one
  token (memory-bound: the fused compressed GEMV wins);
- aggregated (--no-disagg): both in one process; a waiting prompt is prefilled between decode
  steps, stalling every running sequence meanwhile: the baseline disaggregation is measured against.
Each sequence's settings, tokens and stop decision live in its `Sequence` (runtime/model/sampling.py),
handed from prefill to decode worker whole. Token ids go back to the router, which detokenises
and streams.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..model.config import ModelConfig
from ..model.kv_cache import CacheFullError, SeqCache
from ..model.loader import load
from ..model.sampling import Pick, Sequence, choose_rows
from ..threads import governor, set_threads
from .kv_link import ControlStore, KVLink, Transfer
from .protocol import (
    HEARTBEAT_S,
    KV_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    SECRET_ENV,
    SPEC_ENV,
    BadMessage,
    RateLimitedLog,
    ToWorker,
    WorkerSpec,
    curve_keys,
    kv_link_key,
    pack,
    unpack,
)

log = logging.getLogger(__name__)
STALE_S = 3 * KV_TIMEOUT_S  # a received KV cache (or a failed hand-off) waits this long for its decode job
RECONNECT_AFTER_REFUSAL_S = 1.0


def _handshake_events() -> int:
    """What a control socket's monitor reports: its handshakes, failed and succeeded."""
    import zmq

    return (
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
    )


LOGPROB_FLOOR = -9999.0  # what a logprob of -inf is sent as (as vLLM does): JSON has no infinities


def _job_error(e: Exception) -> str:
    """The error a failed job reports: the message of a refusal, the type too of anything else."""
    return str(e) if isinstance(e, (ValueError, CacheFullError)) else f"{type(e).__name__}: {e}"


def finite(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def lp_item(pick: Pick) -> list | None:
    """A token's logprobs as they travel: [logprob, [[id, logprob], ...]], or None."""
    return None if pick.logprob is None else [finite(pick.logprob), [[t, finite(v)] for t, v in pick.top]]


@dataclass(slots=True)
class Slot:
    """One sequence in the running decode batch: its KV cache and its generation state."""

    rid: str
    cache: SeqCache
    seq: Sequence


class Worker:
    """What every worker does: load the model, talk to the router (CURVE, typed messages,
    heartbeats), cancel, keep its KV pool within bounds, prefill and step sequences. Its kind
    (PrefillWorker, DecodeWorker, AggregatedWorker) takes one kind of job (`JOB`) and runs one loop
    (`step`)."""

    ROLE = ""
    JOB = ""

    def __init__(self, spec: WorkerSpec, *, secret: str):
        import zmq

        from .protocol import context_limits

        cfg, name, router = spec.cfg, spec.name, spec.router
        self.role, self.name, self.max_batch, self.parent_pid = self.ROLE, name, cfg.max_batch, spec.parent_pid
        role = self.role
        self.incarnation = uuid.uuid4().hex
        # the same sizes as the router's (one function): a prefill worker holds one sequence of the
        # admitted context, a decode or aggregated worker the pool that its admission and
        # preemption keep within
        self.max_len, pool = context_limits(cfg, ModelConfig.from_folder(cfg.model).max_position_embeddings)
        self.model = load(
            cfg.model,
            cfg.device,
            max_cache_tokens=self.max_len if role == "prefill" else pool,
            kv_cache_dtype=cfg.kv_cache_dtype,
            dtype=cfg.dtype,
        )
        self.ctx = zmq.Context()
        self.keys = curve_keys(secret)
        self.rejected = RateLimitedLog(log)
        self.pool_log = RateLimitedLog(log)  # preemptions: worth knowing about, not every one
        self.sock = self._control_socket(name)
        self.router_url = f"tcp://{router[0]}:{router[1]}"
        self.sock.connect(self.router_url)
        # a peer that fails the CURVE handshake (not the router of this server) is logged here
        self.monitor = self.sock.get_monitor_socket(_handshake_events())
        self._reconnect_at: float | None = None
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.kv_store = self.link = None
        if role in ("prefill", "decode"):  # the rendezvous over a control socket of its own, made when first needed
            self.kv_store = ControlStore(self._kv_socket)
            self.link = KVLink(
                self.kv_store,
                kv_link_key(secret),
                self.incarnation,
                0 if role == "prefill" else 1,
                local_address_towards(router[0]),
                compression=cfg.kv_compression,
                encryption=cfg.kv_encryption,
            )
        self.running: dict[str, Slot] = {}
        self.preempted: deque[tuple[Slot, torch.Tensor]] = deque()  # swapped out to host memory while the pool was full
        self.waiting: deque = deque()  # prompts (aggregated) or received caches (decode) not yet running
        # decode: hand-offs announced (`expect`) whose KV is on its way, with their job once it came
        # (None before); KV that landed before its job; hand-offs that failed before their job came.
        # An entry left by a request that ended elsewhere goes after STALE_S.
        self.pending: dict[str, dict | None] = {}
        self.arrived: dict[str, tuple[torch.Tensor, float]] = {}
        self.lost: dict[str, tuple[str, float]] = {}
        self.cancelled: set[str] = set()
        self.stopping = False
        self.cores = governor() if self.model.device.type == "cpu" else None
        self.send({"op": "hello", "role": role, "pid": os.getpid(), "incarnation": self.incarnation})

    # -- messages -----------------------------------------------------------------------------
    def _control_socket(self, identity: str):
        """A DEALER that talks CURVE to the router and accepts no server but the one holding the
        router's secret key: a fake router cannot feed this worker jobs."""
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.curve_publickey, sock.curve_secretkey = self.keys["worker"]
        sock.curve_serverkey = self.keys["router"][0]
        return sock

    def _kv_socket(self):
        """The KV rendezvous's socket (ControlStore): NAME#kv, used from the link's threads."""
        import zmq

        sock = self._control_socket(f"{self.name}#kv")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.router_url)
        return sock

    def send(self, msg: dict) -> None:
        self.sock.send(pack(msg))

    def emit(self, items: list) -> None:
        if items:
            self.send({"op": "tokens", "items": items})

    def _handshakes(self, monitor) -> bool | None:
        """The handshakes a socket's monitor reported since last asked, failures logged: whether
        the last one succeeded (None if there was none). ZeroMQ retries by itself after some
        failures (a dropped connection) and not after others (a peer speaking another security
        mechanism): a failure followed by a success needs no reconnect of ours, and one would cut
        the working connection and lose what was in flight on it."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        last = None
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return last
            last = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if not last:
                self.rejected.warning(
                    "%s: the control peer at %s failed the CURVE handshake (event %s, error %s): not this server's "
                    "router",
                    self.name,
                    self.router_url,
                    event["event"],
                    event["value"],
                )

    def _reconnect(self, sock) -> None:
        """ZeroMQ gives up on an endpoint whose handshake failed: connect again (the real router
        may take the address over)."""
        import zmq

        try:
            sock.disconnect(self.router_url)
        except zmq.ZMQError:
            pass
        sock.connect(self.router_url)

    def poll(self, timeout_ms: int) -> None:
        import zmq

        events = dict(self.poller.poll(timeout_ms))
        if self.monitor in events:
            last = self._handshakes(self.monitor)
            if last is True:
                self._reconnect_at = None
            elif last is False and self._reconnect_at is None:
                self._reconnect_at = time.monotonic() + RECONNECT_AFTER_REFUSAL_S
        if self._reconnect_at is not None and time.monotonic() >= self._reconnect_at:
            self._reconnect_at = None
            self._reconnect(self.sock)
            self.send({"op": "hello", "role": self.role, "pid": os.getpid(), "incarnation": self.incarnation})
        if self.sock in events:
            while True:
                try:
                    data = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = unpack(data, ToWorker)
                except BadMessage as e:
                    self.rejected.warning("%s: dropped a bad control message: %s", self.name, e)
                    if e.rid is not None:
                        self.fail(e.rid, f"{self.name} got an invalid job: {e}")
                    continue
                try:
                    self.handle(msg)
                except Exception as e:  # noqa: BLE001 - one job's problem is that job's failure, not the worker's
                    log.exception("%s: cannot take %s %s", self.name, msg["op"], msg.get("id"))
                    if msg.get("id") is not None:
                        self.fail(msg["id"], f"{self.name} could not take this job: {type(e).__name__}: {e}")

    def _beat(self) -> None:
        """Heartbeats from a thread with a socket of its own (`NAME#beat`; ZeroMQ sockets are not
        shared between threads), so a long prefill or step never makes the worker look dead.
        Also stops the worker if the router that started it is gone: no orphans."""
        import zmq

        sock = self._control_socket(f"{self.name}#beat")
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(_handshake_events())
        sock.connect(self.router_url)
        try:
            while not self.stopping:
                if self._handshakes(monitor) is False:
                    self._reconnect(sock)  # at most once a heartbeat
                cache = self.model.cache
                sock.send(
                    pack(
                        {
                            "op": "beat",
                            "running": len(self.running),
                            "queued": len(self.waiting) + len(self.pending) + len(self.preempted),
                            "kv_blocks_used": cache.used_blocks,
                            "kv_blocks_total": cache.max_blocks,
                        }
                    )
                )
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.stopping = True
                time.sleep(HEARTBEAT_S)
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()

    def handle(self, msg: dict) -> None:
        op = msg["op"]
        if op == "shutdown":
            self.stopping = True
        elif op == "announce":  # the router does not know us (our hello was lost, or it restarted)
            self.send({"op": "hello", "role": self.role, "pid": os.getpid(), "incarnation": self.incarnation})
        elif op == "cancel":
            self.cancel(msg["id"])
        elif op == self.JOB:
            self.accept(msg)
        else:
            log.warning("%s: ignoring %s", self.name, op)

    def accept(self, job: dict) -> None:
        """A job of this worker's kind: it waits for the loop."""
        self.waiting.append(job)

    def cancel(self, rid: str) -> None:
        slot = self.running.pop(rid, None)
        if slot is not None:
            self.model.free(slot.cache)
        elif rid in self.pending:
            self.cancelled.add(rid)  # its KV is still arriving: drop it when it lands
        self.arrived.pop(rid, None)
        self.lost.pop(rid, None)
        self.waiting = deque(w for w in self.waiting if (w[0] if isinstance(w, tuple) else w)["id"] != rid)
        self.preempted = deque(p for p in self.preempted if p[0].rid != rid)

    # -- the KV pool: admission and preemption ---------------------------------------------------
    # A sequence joins the batch only if the pool has room for it and for the next step of those
    # already running; when a step would still not fit (sequences grow), the newest sequence is
    # swapped out to host memory and comes back first once blocks are free. The admitted context
    # fits the pool (protocol.context_limits), so a sequence alone always fits: nothing is failed
    # for want of room.
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.model.cache.block_size)

    def _free_blocks(self) -> int:
        cache = self.model.cache
        return cache.max_blocks - cache.used_blocks

    def _step_blocks(self) -> int:
        """New blocks the next decode step of the running batch needs."""
        return sum(max(0, self._blocks(s.cache.length + 1) - len(s.cache.blocks)) for s in self.running.values())

    def _fits(self, tokens: int) -> bool:
        """Room for a sequence of `tokens` stored tokens (and its next one) beside the running batch."""
        return not self.running or self._blocks(tokens + 1) + self._step_blocks() <= self._free_blocks()

    def _preempt_newest(self) -> None:
        rid, slot = next(reversed(self.running.items()))
        kv = self.model.cache.export(slot.cache).cpu()
        self.model.free(self.running.pop(rid).cache)
        self.preempted.append((slot, kv))
        self.pool_log.warning(
            "%s: KV pool full (%d blocks of %d tokens): %s swapped out (%d tokens) until blocks free up",
            self.name,
            self.model.cache.max_blocks,
            self.model.cache.block_size,
            rid,
            kv.shape[2],
        )

    def _make_room(self) -> None:
        while len(self.running) > 1 and self._step_blocks() > self._free_blocks():
            self._preempt_newest()

    def _resume_preempted(self) -> None:
        """Swapped-out sequences come back before any new one is admitted (oldest first)."""
        while self.preempted and len(self.running) < self.max_batch and self._fits(self.preempted[0][1].shape[2]):
            slot, kv = self.preempted.popleft()
            slot.cache = self.model.cache.import_(kv)
            self.running[slot.rid] = slot

    def _step(self) -> None:
        """One decode step of the running batch, within the pool."""
        self._make_room()
        try:
            self.decode_step()
        except CacheFullError as e:  # not expected after _make_room; if it happens, shrink the batch
            if len(self.running) > 1:
                self._preempt_newest()
            else:  # one sequence longer than the pool: only a router configured unlike this worker sends one
                rid, slot = self.running.popitem()
                self.model.free(slot.cache)
                self.fail(rid, str(e))

    # -- phases -------------------------------------------------------------------------------
    def prefill(self, job: dict, on_layer=None) -> tuple[SeqCache, Sequence, Pick, str | None]:
        """Run a prompt: its KV cache, its generation state, the first token and a finish reason.
        With `prompt_logprobs` set, the prompt's own logprobs go to the router first.
        `on_layer(cache, i)`: called once layer i's K and V of the whole prompt are stored."""
        seq = Sequence.from_state(job["seq"], self.model.config.vocab_size)
        if self.cores is not None:
            self.cores.step()
        cache = self.model.new_sequence()
        hook = None if on_layer is None else (lambda i: on_layer(cache, i))
        try:
            tokens = torch.tensor(seq.prompt, dtype=torch.int64)
            top = job.get("prompt_logprobs")
            if top is not None:
                logits, scored = self.model.prefill_logprobs(cache, tokens, top, on_layer=hook)
                self.send(
                    {
                        "op": "prompt_logprobs",
                        "id": job["id"],
                        "items": [[finite(lp), [[t, finite(v)] for t, v in alts]] for lp, alts in scored],
                    }
                )
            else:
                logits = self.model.prefill(cache, tokens, on_layer=hook)
            pick = seq.choose(logits)
        except BaseException:
            self.model.free(cache)
            raise
        return cache, seq, pick, seq.append(pick.token)

    def _picks(self, logits: torch.Tensor, slots: list[Slot]) -> list[Pick | None]:
        """The batch's choices; should one sequence's fail, only that one is lost (None)."""
        try:
            return choose_rows(logits, [s.seq for s in slots])
        except Exception:  # noqa: BLE001 - never expected (sampling is total); isolate it rather than lose the batch
            log.exception("%s: batched sampling failed; choosing row by row", self.name)
        picks = []
        for row, slot in zip(logits, slots):
            try:
                picks.append(choose_rows(row[None], [slot.seq])[0])
            except Exception as e:  # noqa: BLE001
                picks.append(None)
                self.fail(slot.rid, f"sampling failed: {type(e).__name__}: {e}")
        return picks

    def decode_step(self) -> None:
        if self.cores is not None:
            self.cores.step()  # fewer threads while another process holds a core
        slots = list(self.running.values())
        self._stepped(slots, self.model.decode_step([s.cache for s in slots], [s.seq.output[-1] for s in slots]))

    def _stepped(self, slots: list[Slot], logits: torch.Tensor) -> None:
        """The running batch's next tokens from its step's logits: emitted, finished sequences freed."""
        items = []
        for slot, pick in zip(slots, self._picks(logits, slots)):
            reason = None if pick is None else slot.seq.append(pick.token)
            if pick is not None:
                items.append(
                    [
                        slot.rid,
                        None if reason == "stop" else pick.token,
                        reason,
                        None if reason == "stop" else lp_item(pick),
                    ]
                )
            if pick is None or reason is not None:
                self.model.free(self.running.pop(slot.rid).cache)
        self.emit(items)

    def fail(self, rid: str, error: str) -> None:
        self.send({"op": "failed", "id": rid, "error": error})

    # -- loops --------------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        beat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        beat.start()
        try:
            while not self.stopping:
                self.step()
        finally:
            self.stopping = True
            beat.join(timeout=2 * HEARTBEAT_S)
            if self.link is not None:
                self.link.close()
                self.kv_store.close()
            self.sock.disable_monitor()
            self.monitor.close()
            self.sock.close()
            self.ctx.term()

    def step(self) -> None:
        raise NotImplementedError

    def _drain_transfers(self) -> None:
        """Finished KV transfers: reported for the metrics, failures reported (a prefill's) or kept
        for their job (a decode's), received caches queued for the batch or kept for their job."""
        while self.link is not None and not self.link.done.empty():
            t = self.link.done.get()
            if t.error is None:  # the bytes moved, whether or not the request still wants them
                self.send(
                    {
                        "op": "transferred",
                        "peer": t.peer,
                        "raw_bytes": t.raw_bytes,
                        "wire_bytes": t.wire_bytes,
                        "seconds": t.seconds,
                        "codec_seconds": t.codec_seconds,
                        "compressed": t.compressed,
                        "sealed": t.sealed,
                    }
                )
            if self.role == "prefill":
                if t.error is not None and not t.aborted:  # aborted: its request already ended here
                    self.fail(t.rid, t.error)
                continue
            job = self.pending.pop(t.rid, None)
            if t.rid in self.cancelled:
                self.cancelled.discard(t.rid)
            elif t.error is not None:
                if job is not None:
                    self.fail(t.rid, t.error)
                elif not t.aborted:  # its job may still come: it fails then
                    self.lost[t.rid] = (t.error, time.monotonic())
            elif job is not None:
                self.waiting.append((job, t.tensor))
            else:
                self.arrived[t.rid] = (t.tensor, time.monotonic())
        now = time.monotonic()
        for held in (self.arrived, self.lost):
            for rid in [rid for rid, (_, at) in held.items() if now - at > STALE_S]:
                del held[rid]  # its request ended before its decode job came (the router failed it)

    def _first_token(self, job: dict, on_layer=None) -> tuple[SeqCache, Sequence, Pick, str | None] | None:
        """Prefill a job and report a first token that ends it; None if the job failed."""
        try:
            cache, seq, pick, reason = self.prefill(job, on_layer)
        except Exception as e:  # noqa: BLE001 - a job that cannot run fails alone
            self.fail(job["id"], _job_error(e))
            return None
        if reason is not None:
            self.model.free(cache)
            self.emit(
                [
                    [
                        job["id"],
                        None if reason == "stop" else pick.token,
                        reason,
                        None if reason == "stop" else lp_item(pick),
                    ]
                ]
            )
        return cache, seq, pick, reason


class PrefillWorker(Worker):
    """One prompt at a time -> first token; its KV cache streams to the decode worker the router
    chose, each layer as soon as the prefill is past it (compute-bound: large matmuls)."""

    ROLE, JOB = "prefill", "prefill"

    def _stream(self, job: dict) -> Transfer:
        """The job's hand-off, started as its prefill starts (`prefilling`: the router tells the
        decode worker to expect it): from here it is sent whole, or aborted."""
        cache = self.model.cache
        tokens = len(job["seq"]["prompt"])
        self.send({"op": "prefilling", "id": job["id"], "tag": job["tag"], "tokens": tokens})
        t = Transfer(
            job["id"],
            job["tag"],
            job["decode"],
            job["decode_incarnation"],
            shape=(cache.layers, 2, tokens, cache.kv_heads, cache.head_dim),
            dtype=str(cache.k.dtype).removeprefix("torch."),
            layers=queue.Queue(),
        )
        self.link.submit(t)
        return t

    def step(self) -> None:
        self.poll(0 if self.waiting else 50)
        self._drain_transfers()
        if not self.waiting:
            return
        job = self.waiting.popleft()
        cache = self.model.cache
        t = self._stream(job)
        shape, tokens = t.shape, t.shape[2]
        sent = 0

        def stream(seq: SeqCache, i: int) -> None:  # gloo moves host tensors: a GPU layer is staged through one
            nonlocal sent
            t.layers.put(cache.export_layer(seq, i, tokens).cpu())
            sent += 1

        done = None
        try:
            done = self._first_token(job, stream)
        finally:
            if done is None or done[3] is not None or sent < cache.layers:
                t.layers.put(None)  # failed or ended during the prefill: the transfer is aborted
        if done is None or done[3] is not None:
            return
        seq_cache, seq, pick, _ = done
        self.model.free(seq_cache)
        self.send(
            {
                "op": "prefilled",
                "id": job["id"],
                "tag": job["tag"],
                "first_token": pick.token,
                "logprobs": lp_item(pick),
                "seq": seq.state(),
                "kv_bytes": int(np.prod(shape)) * cache.k.element_size(),
                "decode": job["decode"],
            }
        )


class DecodeWorker(Worker):
    """Continuous batching: KV caches arriving from prefill workers join the running batch between
    steps, finished sequences leave it (memory-bound: the fused compressed GEMV)."""

    ROLE, JOB = "decode", "decode"

    def handle(self, msg: dict) -> None:
        if msg["op"] == "expect":
            self.expect(msg)
        else:
            super().handle(msg)

    def expect(self, msg: dict) -> None:
        """A hand-off announced as its prefill starts: post the receive now, so each layer is taken
        as the prefill worker sends it."""
        cache = self.model.cache
        if msg["tokens"] > self.max_len:
            raise ValueError(f"a KV cache of {msg['tokens']} tokens is over this worker's context {self.max_len}")
        shape = (cache.layers, 2, msg["tokens"], cache.kv_heads, cache.head_dim)
        self.pending[msg["id"]] = None
        if msg["discard"]:  # sends and receives pair up in order on a link: take it, then drop it
            self.cancelled.add(msg["id"])
        self.link.submit(
            Transfer(
                msg["id"],
                msg["tag"],
                msg["prefill"],
                msg["prefill_incarnation"],
                shape=shape,
                dtype=str(cache.k.dtype).removeprefix("torch."),
            )
        )

    def accept(self, msg: dict) -> None:
        """A decode job: its sequence joins the batch once its KV is here (it may be already)."""
        rid = msg["id"]
        if rid in self.arrived:
            self.waiting.append((msg, self.arrived.pop(rid)[0]))
        elif rid in self.lost:
            self.fail(rid, self.lost.pop(rid)[0])
        elif rid in self.pending:
            self.pending[rid] = msg
        else:
            raise ValueError("no KV hand-off was announced to this worker for this request")

    def _admit(self) -> None:
        self._resume_preempted()
        while (
            self.waiting
            and not self.preempted
            and len(self.running) < self.max_batch
            and self._fits(self.waiting[0][1].shape[2])
        ):
            job, kv = self.waiting.popleft()
            try:
                seq = Sequence.from_state(job["seq"], self.model.config.vocab_size)
                if not seq.output:
                    raise ValueError("a decode job needs the sequence's first token")
                cache = self.model.cache.import_(kv)
            except (ValueError, CacheFullError) as e:
                self.fail(job["id"], str(e))
                continue
            self.running[job["id"]] = Slot(job["id"], cache, seq)

    def step(self) -> None:
        self.poll(0 if self.running else 20)
        self._drain_transfers()
        self._admit()
        if self.running:
            self._step()


class AggregatedWorker(Worker):
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
            if self.running and job.get("prompt_logprobs") is None and self.model.graph_decoder is None:
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
            reason = seq.append(pick.token)
            stop = reason == "stop"
            self.emit([[job["id"], None if stop else pick.token, reason, None if stop else lp_item(pick)]])
            if reason is None:
                self.running[job["id"]] = Slot(job["id"], cache, seq)
            else:
                self.model.free(cache)
        self._stepped(slots, logits)


WORKERS = {cls.ROLE: cls for cls in (PrefillWorker, DecodeWorker, AggregatedWorker)}


def local_address_towards(host: str) -> str:
    """This host's address on the route to `host` (where the worker's own KV sockets listen)."""
    import socket

    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1" if host != "::1" else "::1"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def main(spec: WorkerSpec, secret: str) -> None:
    """Run a worker process: `spec` says what (WorkerSpec), `secret` is the control secret the
    router's and workers' keys are derived from."""
    torch.set_grad_enabled(False)
    if not logging.getLogger().handlers:  # started by hand (`--role`): nothing set logging up
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unweight.runtime.serve.kv_link").setLevel(logging.INFO)  # each link's rate, once
    if spec.threads:
        set_threads(spec.threads)
    WORKERS[spec.role](spec, secret=secret).run()


if __name__ == "__main__":  # how the router starts its workers: the spec and the secret in the environment
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    main(WorkerSpec.from_json(os.environ.pop(SPEC_ENV)), os.environ.pop(SECRET_ENV))
