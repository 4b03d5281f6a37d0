"""The router of `unweight serve`: HTTP in front, workers behind.

It owns the tokenizer (prompts are tokenised here, token ids detokenised and streamed from here),
the control socket every worker connects to, the rendezvous keys through which prefill/decode
pairs build their KV groups (kv_link.Rendezvous, asked over that socket), and the worker processes
it started: it watches them, fails the requests of one that dies, restarts it, and reports all of
them in /health and /metrics.

A request's life (disaggregated): tokens -> least-loaded prefill worker (told which decode worker
will take it) -> `prefilled` (first token streamed now; the KV is on its way) -> the decode worker
receives the KV and joins it to its batch -> `tokens` messages until EOS, max_tokens or a stop
string (then the router cancels the rest). Aggregated (--no-disagg): one worker does both.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pydantic import BaseModel

from ..kv.secret import new_secret, read_secret_file
from ..model.sampling import SamplingParams, Sequence
from .kv_link import Rendezvous
from .metrics import Metrics
from .protocol import (
    KV_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    SECRET_ENV,
    SPEC_ENV,
    BadMessage,
    Beat,
    ErrorCode,
    Failed,
    Hello,
    Prefilled,
    Prefilling,
    PromptLogprobs,
    RateLimitedLog,
    ServeConfig,
    TokensMsg,
    ToRouter,
    Transferred,
    WorkerSpec,
    curve_keys,
    pack,
    parse,
)

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = 1.0
DRAIN_BATCH = 64  # control messages read in one turn of the event loop before HTTP gets its turn
CHANNELS = {
    "beat": "beat",
    "kv_set": "kv",
    "kv_get": "kv",
}  # the socket (NAME#...) an op comes on; every other op comes on NAME


class Overloaded(Exception):
    """Too many requests in flight; the client should retry later."""


class Unavailable(Exception):
    """No ready worker of a needed role (starting, or restarting after a crash)."""


@dataclass(slots=True)
class WorkerHandle:
    name: str
    role: str
    command: list[str] | None = None  # how to start it again (None: started by someone else)
    spec: str = ""  # its WorkerSpec, as JSON
    proc: subprocess.Popen | None = None
    pid: int | None = None
    incarnation: str | None = None
    state: str = "starting"  # starting | ready | unresponsive | dead
    last_seen: float = 0.0
    running: int = 0
    queued: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens: int = 0  # prompt tokens prefilled or copied, over the worker's processes
    prompt_tokens_reused: int = 0  # of those, copied from a prompt just run (SharedPrompt)
    beat_prompt: tuple[int, int] = (0, 0)  # the two as the current process's last heartbeat said them
    restarts: int = 0
    served: int = 0  # requests this worker took part in
    inflight: set[str] = field(default_factory=set)
    sending: set[str] = field(
        default_factory=set
    )  # prefill: requests whose KV it may still be sending (it may report them failed)
    draining: dict[str, tuple[str, float]] = field(
        default_factory=dict
    )  # prefill: cancelled mid-prefill -> (decode worker, when)
    died_at: float = 0.0

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "pid": self.pid,
            "state": self.state,
            "running": self.running,
            "queued": self.queued,
            "kv_blocks_used": self.kv_blocks_used,
            "restarts": self.restarts,
            "served": self.served,
        }

    @property
    def load(self) -> int:
        return len(self.inflight) + self.queued


@dataclass(slots=True)
class Request:
    rid: str
    tag: int
    tokens: list[int]
    # ("token", id or None, finish reason or None, logprobs or None) | ("prompt", logprobs, None, None)
    # | ("error", message, ErrorCode, None)
    events: asyncio.Queue
    created: float = field(default_factory=time.monotonic)
    holder: str | None = None  # the worker holding its state now
    decode: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    done: bool = False


class Router:
    def __init__(self, cfg: ServeConfig, eos: list[int], metrics: Metrics):
        self.cfg, self.eos, self.metrics = cfg, eos, metrics
        self.workers: dict[str, WorkerHandle] = {}
        self.requests: dict[str, Request] = {}
        self._tags = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.rendezvous = Rendezvous()
        self.closing = False
        self.rejected = RateLimitedLog(log)  # unauthenticated peers and bad messages: logged, rate-limited
        self.secret = read_secret_file(cfg.control_secret_file) if cfg.control_secret_file else new_secret()

    # -- start and stop -----------------------------------------------------------------------
    async def start(self) -> None:
        import zmq
        import zmq.asyncio
        from zmq.auth.asyncio import AsyncioAuthenticator

        cfg = self.cfg
        self.ctx = zmq.asyncio.Context()
        # CURVE: the ZAP handler admits only the workers' key, derived from the secret (a peer
        # without it cannot even finish the handshake, so none of its bytes reach _handle)
        keys = curve_keys(self.secret)
        self.auth = AsyncioAuthenticator(self.ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.auth.start()
        self.auth.configure_curve_callback("*", _AllowList(keys["worker"][0], self.rejected))
        # a plain socket read from the loop's own reader (_drain), not zmq.asyncio's: its future,
        # timers and enum flag operations for every message were the largest item of the router's
        # CPU per streamed token under cProfile
        self.sock = zmq.Socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its name back
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = keys["router"]
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        bind_host = cfg.host if cfg.host not in ("localhost",) else "127.0.0.1"
        if cfg.control_port:
            self.sock.bind(f"tcp://{bind_host}:{cfg.control_port}")
            self.control_port = cfg.control_port
        else:
            self.control_port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.FD, self._drain)
        loop.call_soon(self._drain)  # the FD signals changes only: read what may already wait
        self._tasks = [
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._watch_handshakes()),
        ]
        for role, count in self._local_workers():
            for i in range(count):
                self._spawn(WorkerHandle(f"{role}-{i}", role))

    def _local_workers(self) -> list[tuple[str, int]]:
        if not self.cfg.disaggregated:
            return [("worker", 1)]
        return [("prefill", self.cfg.prefill_workers), ("decode", self.cfg.decode_workers)]

    def _spawn(self, w: WorkerHandle) -> None:
        cfg = self.cfg
        if (
            w.command is None
        ):  # the worker's own entry point, its whole config as a WorkerSpec: no CLI flags to keep in step
            local = sum(n for _, n in self._local_workers()) or 1
            spec = WorkerSpec(
                cfg=cfg,
                role=w.role,
                name=w.name,
                router=(_connect_host(cfg.host), self.control_port),
                parent_pid=os.getpid(),
                threads=cfg.worker_threads or max(1, _cpus() // local),
            )
            w.command = [sys.executable, "-m", "unweight.runtime.serve.worker"]
            w.spec = spec.to_json()
        env = {
            **os.environ,
            SECRET_ENV: self.secret,
            SPEC_ENV: w.spec,
        }  # the environment, not argv: argv is visible to every user in ps
        w.proc = subprocess.Popen(w.command, stdin=subprocess.DEVNULL, env=env)
        w.pid, w.state, w.incarnation, w.last_seen = w.proc.pid, "starting", None, time.monotonic()
        self.workers[w.name] = w

    async def stop(self) -> None:
        """Fail what is in flight, ask workers to stop, then make sure they did."""
        self.closing = True
        for r in list(self.requests.values()):
            self._finish_error(r, "the server is shutting down")
        for w in self.workers.values():
            await self._send(w.name, {"op": "shutdown"})
        deadline = time.monotonic() + 10
        for w in self.workers.values():
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for t in self._tasks:
            t.cancel()
        asyncio.get_running_loop().remove_reader(self.sock.FD)
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
        self.auth.stop()
        self.ctx.term()

    # -- worker traffic -----------------------------------------------------------------------
    async def _send(self, name: str, msg: dict) -> None:
        import zmq

        try:  # a ROUTER socket never blocks a send: one to a peer that is gone or full is dropped
            self.sock.send_multipart([name.encode(), pack(msg)], zmq.NOBLOCK)
        except Exception as e:  # noqa: BLE001 - an unroutable worker shows up as dead through the watcher
            log.warning("cannot reach %s: %s", name, e)
        # a send may take in the socket's pending notices, the FD's only signal that messages wait
        asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Read and handle the control messages waiting, DRAIN_BATCH at most a turn of the loop (the
        rest at the next turn, after the HTTP work already due)."""
        import zmq

        for _ in range(DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:  # the socket is closed (stop)
                log.debug("control socket: %s", e)
                return
            self._receive(frames)
        asyncio.get_running_loop().call_soon(self._drain)

    def _receive(self, frames: list[bytes]) -> None:
        """One control message: checked (frames, its typed model, the socket it came on), then to
        its handler; a bad one is dropped and logged, and nothing it holds goes on."""
        try:
            if len(frames) != 2:
                raise BadMessage(f"{len(frames) - 1} frames, not 1", None)
            ident, data = frames
            name, _, channel = ident.decode("ascii", "replace").partition("#")  # NAME, NAME#beat or NAME#kv
            msg = parse(data, ToRouter)
        except BadMessage as e:
            self.rejected.warning("dropped a bad control message from %r: %s", frames[0][:64], e)
            self._bad_message_from(frames[0].decode("ascii", "replace").partition("#")[0], e.rid)
            return
        try:
            want = CHANNELS.get(msg.op, "")
            if channel != want:
                self.rejected.warning(
                    "dropped %s from %r: it comes on NAME%s", msg.op, ident[:64], f"#{want}" if want else ""
                )
                return
            if channel == "kv":
                self._rendezvous(name, msg.model_dump())
            else:
                self._handle(name, msg)
        except Exception:  # noqa: BLE001 - a bug here must not take the router down
            log.exception("error handling %s from %r", msg.op, name)

    def _rendezvous(self, name: str, msg: dict) -> None:
        """A KV rendezvous request (kv_set, kv_get) from a worker's NAME#kv socket: answered there."""
        w = self.workers.get(name)
        if w is None or w.state != "ready" or w.incarnation is None:
            reply = {
                "op": "kv_reply",
                "n": msg["n"],
                "value": None,
                "error": f"{name} is not a ready worker of this server",
            }
        else:
            live = {"prefill": set(), "decode": set()}
            for other in self.workers.values():
                if other.state == "ready" and other.role in live and other.incarnation is not None:
                    live[other.role].add(other.incarnation)
            reply = self.rendezvous.handle(w.role, w.incarnation, live, msg)
        if reply["error"] is not None:
            self.rejected.warning("refused %s of %r from %s: %s", msg["op"], msg["key"][:80], name, reply["error"])
        asyncio.get_running_loop().create_task(self._send(f"{name}#kv", reply))

    def _bad_message_from(self, name: str, rid: str | None) -> None:
        """A worker's message about a request it holds was unreadable: that request cannot go on."""
        w = self.workers.get(name)
        r = self.requests.get(rid) if rid is not None else None
        if w is not None and r is not None and (rid in w.inflight or rid in w.sending):
            self._finish_error(r, f"worker {name} sent an invalid message about this request")

    async def _watch_handshakes(self) -> None:
        """Peers that failed the CURVE handshake (no key, or not this server's): logged, rate-limited."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            self.rejected.warning(
                "refused a control connection on %s: CURVE handshake failed (event %s, error %s): not a worker of "
                "this server",
                event["endpoint"].decode(errors="replace"),
                event["event"],
                event["value"],
            )

    def _handle(self, name: str, msg: BaseModel) -> None:
        """A message on a worker's main or beat socket, to its op's handler (`_ON`); nothing but a
        hello is taken from a worker that has not said hello."""
        if isinstance(msg, Hello):
            w = self._on_hello(name, msg)
            if w is not None:
                w.last_seen = time.monotonic()
            return
        w = self.workers.get(name)
        if w is None:
            self.rejected.warning("dropped %s from %r: no hello from it yet", msg.op, name)
            if isinstance(msg, Beat):  # its hello was lost (a connection that failed), or this router restarted
                asyncio.get_running_loop().create_task(self._send(name, {"op": "announce"}))
            return
        w.last_seen = time.monotonic()
        handler = self._ON.get(msg.op)
        if handler is not None:
            handler(self, w, msg)

    def _on_hello(self, name: str, msg: Hello) -> WorkerHandle | None:
        """The worker, registered and ready; None if it claims another role than it was registered with."""
        w = self.workers.get(name)
        if w is None:  # a worker started by hand (--role prefill|decode on another host)
            w = self.workers[name] = WorkerHandle(name, msg.role)
        elif w.role != msg.role:
            self.rejected.warning(
                "dropped hello from %s: it says role %s, it was registered as %s", name, msg.role, w.role
            )
            return None
        if w.incarnation is not None and w.incarnation != msg.incarnation:  # restarted by hand: it holds nothing now
            self._fail_held(w, f"worker {name} restarted while serving this request")
        w.pid, w.incarnation, w.state = msg.pid, msg.incarnation, "ready"
        return w

    def _on_beat(self, w: WorkerHandle, msg: Beat) -> None:
        w.running, w.queued = msg.running, msg.queued
        w.kv_blocks_used, w.kv_blocks_total = msg.kv_blocks_used, msg.kv_blocks_total
        now = (msg.prompt_tokens, msg.prompt_tokens_reused)
        was = (0, 0) if now[0] < w.beat_prompt[0] or now[1] < w.beat_prompt[1] else w.beat_prompt  # new process
        w.prompt_tokens += now[0] - was[0]
        w.prompt_tokens_reused += now[1] - was[1]
        w.beat_prompt = now
        if w.state == "unresponsive":
            w.state = "ready"

    def _on_prefilling(self, w: WorkerHandle, msg: Prefilling) -> None:
        """Its KV starts streaming now: the decode worker posts its receive."""
        rid = msg.id
        r = self.requests.get(rid)
        live = r is not None and not r.done and rid in w.inflight
        decode = r.decode if live else w.draining.get(rid, (None,))[0]
        if decode is None or decode not in self.workers:
            self.rejected.warning("dropped prefilling for %s from %s: not a request it holds", rid, w.name)
            return
        expect = {"op": "expect", "id": rid, "tag": msg.tag, "tokens": msg.tokens, "prefill": w.name}
        expect |= {"prefill_incarnation": w.incarnation, "discard": not live}  # discard: it was cancelled
        asyncio.get_running_loop().create_task(self._send(decode, expect))

    def _on_prefilled(self, w: WorkerHandle, msg: Prefilled) -> None:
        """The first token: streamed now, and the sequence's decode job goes to its decode worker."""
        rid = msg.id
        r = self.requests.get(rid)
        if rid in w.draining:  # cancelled during its prefill: its decode worker was told to drop the KV
            del w.draining[rid]
            return
        if r is None or rid not in w.inflight or r.done:
            self.rejected.warning("dropped prefilled for %s from %s: not a request it holds", rid, w.name)
            return
        w.inflight.discard(rid)
        w.sending.add(rid)
        self.metrics.kv_sent(w.name, r.decode, msg.kv_bytes)
        self._token(r, msg.first_token, None, msg.logprobs)
        d = self.workers.get(r.decode)
        if d is None or d.state != "ready":  # (_release tells it, should it wake up, to drop the KV)
            self._finish_error(r, f"decode worker {r.decode} is {'gone' if d is None else d.state}")
            return
        r.holder = d.name
        d.inflight.add(r.rid)
        d.served += 1
        job = {"op": "decode", "id": r.rid, "seq": msg.seq.model_dump()}
        asyncio.get_running_loop().create_task(self._send(d.name, job))

    def _on_tokens(self, w: WorkerHandle, msg: TokensMsg) -> None:
        for rid, token, finish, logprobs in msg.items:
            r = self.requests.get(rid)
            if rid not in w.inflight:  # finished or cancelled meanwhile, or never its request
                continue
            if r is not None and not r.done:
                self._token(r, token, finish, logprobs)

    def _on_prompt_logprobs(self, w: WorkerHandle, msg: PromptLogprobs) -> None:
        r = self.requests.get(msg.id)
        if r is not None and not r.done and msg.id in w.inflight and len(msg.items) == len(r.tokens) - 1:
            r.events.put_nowait(("prompt", msg.items, None, None))

    def _on_transferred(self, w: WorkerHandle, msg: Transferred) -> None:
        peer = self.workers.get(msg.peer)
        if w.role in ("prefill", "decode") and peer is not None and peer.role != w.role:
            self.metrics.kv_transferred(w.role, w.name, msg.model_dump())

    def _on_failed(self, w: WorkerHandle, msg: Failed) -> None:
        rid = msg.id
        if w.draining.pop(rid, None) is not None:
            return
        r = self.requests.get(rid)
        if r is not None and (rid in w.inflight or rid in w.sending):
            self._finish_error(r, msg.error, msg.code)

    _ON = {  # op -> handler, for every op but hello (which registers the worker) and the kv_ ops (_rendezvous)
        "beat": _on_beat,
        "prefilling": _on_prefilling,
        "prefilled": _on_prefilled,
        "tokens": _on_tokens,
        "prompt_logprobs": _on_prompt_logprobs,
        "transferred": _on_transferred,
        "failed": _on_failed,
    }

    def _fail_held(self, w: WorkerHandle, error: str, gone: bool = True) -> None:
        """Fail the requests the worker holds. Those whose KV it was sending are held by their decode
        worker now, which fails them itself if the KV never arrives."""
        for rid in list(w.inflight):
            r = self.requests.get(rid)
            if r is not None:
                self._finish_error(r, error)
        w.inflight.clear()
        if gone:  # nothing more will come from this incarnation (a hung one may still send `prefilled`)
            w.sending.clear()
            w.draining.clear()

    def _token(self, r: Request, token: int | None, finish: str | None, logprobs: list | None = None) -> None:
        now = time.monotonic()
        if token is not None:
            if r.first_at is None:
                r.first_at = now
            self.metrics.token(r.rid, r.holder, now)
            r.last_at = now
        r.events.put_nowait(("token", token, finish, logprobs))
        if finish is not None:
            self._release(r, finish, finished=True)

    def _finish_error(self, r: Request, error: str, code: ErrorCode = "worker_failed") -> None:
        if not r.done:
            r.events.put_nowait(("error", error, code, None))
            self._release(r, "error")

    def _release(self, r: Request, reason: str, finished: bool = False) -> None:
        """The request is over (`reason`, for the metrics): `finished` when its worker ended it,
        else (cancelled, failed) a prefill may still send its KV, to be received and dropped."""
        if not r.done:
            self.metrics.finished(r.rid, reason)
        r.done = True
        self.requests.pop(r.rid, None)
        if r.decode is not None and r.holder != r.decode and r.decode in self.workers:
            # its KV was announced to the decode worker, which never got its job: drop it there
            asyncio.get_running_loop().create_task(self._send(r.decode, {"op": "cancel", "id": r.rid}))
        for w in self.workers.values():
            if not finished and r.rid in w.inflight and w.role == "prefill" and r.decode is not None:
                w.draining[r.rid] = (r.decode, time.monotonic())  # its `prefilled` may still come
            w.inflight.discard(r.rid)
            w.sending.discard(r.rid)

    async def _watch(self) -> None:
        """Find dead or silent workers; fail their requests; restart the ones we started."""
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for w in list(self.workers.values()):
                exited = w.proc is not None and w.proc.poll() is not None
                if exited and w.state != "dead":
                    log.error("worker %s (pid %s) exited with %s", w.name, w.pid, w.proc.returncode)
                    w.state, w.died_at = "dead", now
                    self._fail_held(w, f"worker {w.name} died while serving this request")
                elif not exited and w.state == "ready" and now - w.last_seen > self.cfg.worker_timeout:
                    # hung (stopped, stuck, cut off): its requests fail now rather than wait forever;
                    # if it comes back, its beats make it ready again and it is told to drop them
                    log.error(
                        "worker %s (pid %s) silent for %.1f s: failing its %d request(s)",
                        w.name,
                        w.pid,
                        now - w.last_seen,
                        len(w.inflight),
                    )
                    w.state = "unresponsive"
                    held = set(w.inflight)
                    self._fail_held(w, f"worker {w.name} stopped responding while serving this request", gone=False)
                    for rid in held:
                        asyncio.get_running_loop().create_task(self._send(w.name, {"op": "cancel", "id": rid}))
                for rid, (_, since) in list(w.draining.items()):  # a `prefilled` that never came
                    if now - since > 3 * KV_TIMEOUT_S:
                        del w.draining[rid]
                if (
                    w.state == "dead"
                    and w.command is not None
                    and not self.closing
                    and now - w.died_at >= RESTART_BACKOFF_S
                ):
                    w.restarts += 1
                    self._spawn(w)

    # -- requests -----------------------------------------------------------------------------
    def ready(self) -> bool:
        roles = {w.role for w in self.workers.values() if w.state == "ready"}
        return {"prefill", "decode"} <= roles if self.cfg.disaggregated else "worker" in roles

    def _pick(self, role: str) -> WorkerHandle:
        ready = [w for w in self.workers.values() if w.role == role and w.state == "ready"]
        if not ready:
            raise Unavailable("no worker is ready" if role == "worker" else f"no {role} worker is ready")
        return min(ready, key=lambda w: (w.load + w.running, w.name))

    def room(self) -> int:
        """Requests that may still be admitted before new ones get 429."""
        return self.cfg.max_queue - len(self.requests)

    async def submit(
        self, rid: str, tokens: list[int], params: SamplingParams, prompt_logprobs: int | None = None
    ) -> Request:
        """Start one sequence (a choice of a request): its events arrive on the returned
        Request's queue. prompt_logprobs: also score the prompt, with that many alternatives."""
        if self.room() < 1:
            raise Overloaded(f"{len(self.requests)} requests in flight (max {self.cfg.max_queue})")
        seq = Sequence(params, tokens, self.eos).state()
        r = Request(rid, next(self._tags) % (1 << 30), tokens, asyncio.Queue())
        if self.cfg.disaggregated:
            p, d = self._pick("prefill"), self._pick("decode")
            r.holder, r.decode = p.name, d.name
            msg = {
                "op": "prefill",
                "id": rid,
                "tag": r.tag,
                "seq": seq,
                "prompt_logprobs": prompt_logprobs,
                "decode": d.name,
                "decode_incarnation": d.incarnation,
            }
        else:
            p = self._pick("worker")
            r.holder = p.name
            msg = {"op": "generate", "id": rid, "seq": seq, "prompt_logprobs": prompt_logprobs}
        p.inflight.add(rid)
        p.served += 1
        self.requests[rid] = r
        self.metrics.admitted(rid, len(tokens), r.created)
        await self._send(p.name, msg)
        return r

    async def cancel(self, r: Request, reason: str = "abort") -> None:
        """The client left ("abort") or a stop string ended it ("stop"): free its batch slot and KV cache."""
        if r.done and r.holder is None:
            return
        holder = r.holder
        self._release(r, reason)  # which tells a decode worker still waiting for its job
        if holder is not None:
            await self._send(holder, {"op": "cancel", "id": r.rid})


class _AllowList:
    """ZAP credentials check: only the workers' public key (from the shared secret) gets in."""

    def __init__(self, worker_key: bytes, rejected: RateLimitedLog):
        self.key, self.rejected = worker_key, rejected

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.key)
        if not ok:
            self.rejected.warning(
                "refused a control connection: CURVE key %s is not this server's worker key",
                key[:8].decode(errors="replace") + "...",
            )
        return ok


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "localhost", "") else host
