"""What every worker process of `unweight serve` does, whatever its role: talk to the router
(CURVE, typed messages, heartbeats), take its kind of job, cancel, prefill a prompt, and run its
loop. The roles are subclasses: PrefillWorker (prefill_worker.py), DecodeWorker (decode_worker.py)
and AggregatedWorker (aggregated_worker.py), the last two over the running batch of batch.py;
worker.py builds one and runs it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..model.kv_cache import CacheFullError, SeqCache
from ..model.sampling import Pick, Sequence
from ..threads import governor
from .kv_link import TransferResult
from .protocol import (
    HEARTBEAT_S,
    MAX_MESSAGE_BYTES,
    BadMessage,
    ErrorCode,
    RateLimitedLog,
    ToWorker,
    WorkerSpec,
    curve_keys,
    pack,
    unpack,
)

log = logging.getLogger("unweight.runtime.serve.worker")
RECONNECT_AFTER_REFUSAL_S = 1.0  # the least time between two handshakes of one control socket
GIVE_UP_AFTER_TIMEOUTS = 3  # a worker whose every handshake is refused for this many --worker-timeout exits


class RefusedByRouter(ValueError):
    """Every CURVE handshake with the router failed for GIVE_UP_AFTER_TIMEOUTS x --worker-timeout:
    this worker does not hold its router's control secret (or something else listens there)."""


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
class SharedPrompt:
    """A prompt just prefilled whose choices (n, best_of) or repeats wait behind it: its KV cache on
    the host (layers, 2, tokens, kv_heads, head_dim), its last logits and its scored prompt, so that
    each of them starts from a copy instead of prefilling the prompt again (as vLLM's prefix cache
    shares a prompt's blocks between a request's sequences). Bit for bit what a prefill gives."""

    key: tuple  # (prompt token ids, prompt_logprobs)
    kv: torch.Tensor
    logits: torch.Tensor
    scored: list | None


def _prompt_key(job: dict) -> tuple:
    return tuple(job["seq"]["prompt"]), job.get("prompt_logprobs")


class Worker:
    """What every worker does: talk to the router (CURVE, typed messages, heartbeats), cancel,
    prefill a prompt. Its role (a subclass) takes one kind of job (`JOB`), runs one loop (`step`),
    and says how many tokens its KV pool holds (`cache_tokens`) and whether it has a KV link
    (`LINK_RANK`: 0 sends, 1 receives)."""

    ROLE = ""
    JOB = ""
    LINK_RANK: int | None = None

    def __init__(self, spec: WorkerSpec, model, max_len: int, *, secret: str):
        """`model`: the loaded CausalLM, its pool sized by `cache_tokens`; `max_len`: the admitted context."""
        import zmq

        cfg, name, router = spec.cfg, spec.name, spec.router
        self.role, self.name, self.max_batch, self.parent_pid = self.ROLE, name, cfg.max_batch, spec.parent_pid
        self.incarnation = uuid.uuid4().hex
        self.max_len, self.model = max_len, model
        self.ctx = zmq.Context()
        self.keys = curve_keys(secret)
        self.rejected = RateLimitedLog(log)
        self.sock = self._control_socket(name)
        self.router_url = f"tcp://{router[0]}:{router[1]}"
        self.sock.connect(self.router_url)
        # a peer that fails the CURVE handshake (not the router of this server) is logged here
        self.monitor = self.sock.get_monitor_socket(_handshake_events())
        self._reconnect_at: float | None = None
        self._refused_since: float | None = None  # the first of an unbroken run of failed handshakes
        self.give_up_after = GIVE_UP_AFTER_TIMEOUTS * cfg.worker_timeout
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.kv_store = self.link = None  # a role with a KV link gets it from worker.open_link before it runs
        self.waiting: deque = deque()  # jobs (or, decode: received caches with their jobs) not yet running
        self.shared: SharedPrompt | None = None  # the last prompt, while jobs that repeat it wait
        self.deferred: deque[dict] = deque()  # messages a poll between a step's phases kept for the next
        self.prompt_tokens = self.prompt_tokens_reused = 0  # prompt tokens prefilled or copied; copied
        self.stopping = False
        self.cores = governor() if self.model.device.type == "cpu" else None
        self.send({"op": "hello", "role": self.role, "pid": os.getpid(), "incarnation": self.incarnation})

    @staticmethod
    def cache_tokens(max_len: int, pool: int) -> int:
        """The tokens its KV pool holds, of (the admitted context, the server's pool size)."""
        return pool

    def running_count(self) -> int:
        """Sequences in its running batch (the heartbeat's `running`)."""
        return 0

    def queued_count(self) -> int:
        """Sequences waiting (the heartbeat's `queued`)."""
        return len(self.waiting)

    # -- messages -----------------------------------------------------------------------------
    def _control_socket(self, identity: str):
        """A DEALER that talks CURVE to the router and accepts no server but the one holding the
        router's secret key: a fake router cannot feed this worker jobs."""
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # ZeroMQ retries a refused handshake by itself, every 100 ms by default: a worker holding
        # another secret would knock on the router ten times a second per socket
        sock.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_AFTER_REFUSAL_S * 1000))
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

    def poll(self, timeout_ms: int, jobs_only: bool = False) -> None:
        """Take in the router's messages. `jobs_only` (from within a step, between its phases): take
        in new jobs only, and keep every other message (a cancel, a shutdown) for the next poll,
        which handles them first: the step in progress is not changed under it."""
        import zmq

        if not jobs_only:
            while self.deferred:
                self._dispatch(self.deferred.popleft())
        events = dict(self.poller.poll(timeout_ms))
        if self.monitor in events:
            last = self._handshakes(self.monitor)
            if last is True:
                self._reconnect_at = self._refused_since = None
            elif last is False:
                if self._reconnect_at is None:
                    self._reconnect_at = time.monotonic() + RECONNECT_AFTER_REFUSAL_S
                if self._refused_since is None:
                    self._refused_since = time.monotonic()
        if self._refused_since is not None and time.monotonic() - self._refused_since > self.give_up_after:
            raise RefusedByRouter(
                f"{self.name}: every CURVE handshake with {self.router_url} failed for {self.give_up_after:.0f} s "
                f"(3 x --worker-timeout): the router there does not hold this worker's control secret (give the "
                f"worker the router's --control-secret-file)"
            )
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
                if jobs_only and msg["op"] != self.JOB:
                    self.deferred.append(msg)
                else:
                    self._dispatch(msg)

    def _dispatch(self, msg: dict) -> None:
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
        reconnected = time.monotonic()
        try:
            while not self.stopping:
                if self._handshakes(monitor) is False and time.monotonic() - reconnected >= RECONNECT_AFTER_REFUSAL_S:
                    self._reconnect(sock)
                    reconnected = time.monotonic()
                cache = self.model.cache
                sock.send(
                    pack(
                        {
                            "op": "beat",
                            "running": self.running_count(),
                            "queued": self.queued_count(),
                            "kv_blocks_used": cache.used_blocks,
                            "kv_blocks_total": cache.max_blocks,
                            "prompt_tokens": self.prompt_tokens,
                            "prompt_tokens_reused": self.prompt_tokens_reused,
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
        self.waiting = deque(w for w in self.waiting if self._rid_of(w) != rid)

    @staticmethod
    def _rid_of(waiting) -> str:
        """The request id of an entry of `waiting`."""
        return waiting["id"]

    # -- phases -------------------------------------------------------------------------------
    def prefill(
        self, job: dict, on_layer=None, cache: SeqCache | None = None
    ) -> tuple[SeqCache, Sequence, Pick, str | None]:
        """Run a prompt: its KV cache, its generation state, the first token and a finish reason.
        With `prompt_logprobs` set, the prompt's own logprobs go to the router first.
        `on_layer(cache, i)`: called once layer i's K and V of the whole prompt are stored. A prompt
        that the last one repeats (SharedPrompt) is copied, not run; one that jobs waiting behind it
        repeat is kept for them. `cache`: the prompt's first tokens already in (chunks run before:
        the rest is run now; not with prompt_logprobs)."""
        seq = Sequence.from_state(job["seq"], self.model.config.vocab_size)
        key = _prompt_key(job)
        shared = self.shared if cache is None and self.repeats_shared(key) else None
        if shared is None and self.cores is not None:
            self.cores.step()
        cache = cache if cache is not None else self.model.new_sequence()
        hook = None if on_layer is None else (lambda i: on_layer(cache, i))
        try:
            if shared is not None:
                cache = self.model.cache.import_(shared.kv)
                for i in range(self.model.cache.layers if hook is not None else 0):
                    on_layer(cache, i)
                logits, scored = shared.logits, shared.scored
            else:
                tokens = torch.tensor(seq.prompt[cache.length :], dtype=torch.int64)
                top = job.get("prompt_logprobs")
                if top is not None and cache.length:
                    raise ValueError("a prompt scored for its logprobs is prefilled whole")
                if top is not None:
                    logits, scored = self.model.prefill_logprobs(cache, tokens, top, on_layer=hook)
                else:
                    logits, scored = self.model.prefill(cache, tokens, on_layer=hook), None
            if scored is not None:
                self.send(
                    {
                        "op": "prompt_logprobs",
                        "id": job["id"],
                        "items": [[finite(lp), [[t, finite(v)] for t, v in alts]] for lp, alts in scored],
                    }
                )
            pick = seq.choose(logits)
            self._share(job["id"], key, cache, logits, scored)
            self.prompt_tokens += len(seq.prompt)
            self.prompt_tokens_reused += len(seq.prompt) if shared is not None else 0
        except BaseException:
            self.model.free(cache)
            raise
        return cache, seq, pick, seq.append(pick.token)

    def repeats_shared(self, key: tuple) -> bool:
        """Whether a prompt (its _prompt_key) is the one kept as `shared`."""
        return self.shared is not None and self.shared.key == key

    def not_started(self) -> Iterator[dict]:
        """The jobs taken in whose prompts have not begun to run."""
        return iter(self.waiting)

    def _share(self, rid: str, key: tuple, cache: SeqCache, logits: torch.Tensor, scored: list | None) -> None:
        """Keep the prompt just run (request `rid`'s) for the jobs not started yet that repeat it (a
        request's other choices, which follow its first within a moment, or came with it: the jobs
        sent meanwhile are taken in first). One prompt is kept at a time: the one kept before stays
        while jobs that repeat it have not started, unless this one replaces it."""
        if self.repeats_shared(key):
            return
        self.poll(0, jobs_only=True)
        queued = [_prompt_key(w) for w in self.not_started() if w["id"] != rid]
        if key in queued:
            self.shared = SharedPrompt(key, self.model.cache.export(cache).cpu(), logits, scored)
        elif self.shared is not None and self.shared.key not in queued:
            self.shared = None

    def fail(self, rid: str, error: str, code: ErrorCode = "worker_failed") -> None:
        """Request `rid` failed here: the router ends it with `error`, and clients see `code`."""
        self.send({"op": "failed", "id": rid, "error": error, "code": code})

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
        """Finished KV transfers: reported for the metrics, then to the role (`_transfer_done`)."""
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
            self._transfer_done(t)

    def _transfer_done(self, t: TransferResult) -> None:
        raise NotImplementedError

    def _first_token(
        self, job: dict, on_layer=None, cache: SeqCache | None = None
    ) -> tuple[SeqCache, Sequence, Pick, str | None] | None:
        """Prefill a job (the rest of its prompt, after the chunks in `cache`) and report a first
        token that ends it; None if the job failed (its cache freed)."""
        try:
            cache, seq, pick, reason = self.prefill(job, on_layer, cache)
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
