"""UnweightConnector: a vLLM v1 KV connector that moves a prefill engine's KV cache to a decode engine
coded losslessly with the project's KV codec (runtime/kv/wire.py) and, between engines that hold
the secret, sealed; it speaks NixlConnector's `kv_transfer_params` handshake, so vLLM's proxies,
llm-d's routing and `unweight serve --role router --engine vllm` drive it unchanged.

    vllm serve DIR --kv-transfer-config '{"kv_connector":"UnweightConnector",
        "kv_connector_module_path":"unweight.runtime.vllm.kv_connector","kv_role":"kv_producer",
        "kv_connector_extra_config":{"secret_file":F,"host":H,"port":P}}'    (kv_consumer: the decode side)

kv_connector_extra_config:
    secret_file        the control secret (runtime/kv/secret.py: one line of >= 32 characters, mode
                       600), the same file on both engines. With it, both sides prove it on every
                       connection and everything after the proofs is sealed (ChaCha20-Poly1305).
                       Without it the engines talk only over loopback: an engine whose host is not
                       loopback refuses to start, a pull from a non-loopback host is refused.
    host, port         where a prefill engine's side channel listens; the decode engine learns them
                       from kv_transfer_params (remote_host, remote_port).
    kv_compression     "on" (default): a decode engine asks for frames coded losslessly (0.68x BF16's
                       bytes on SmolLM2), at the codec's speed (tens of MB/s a thread); "off": raw
                       frames, for a link faster than the codec.
    kv_lease_duration  seconds a prefill engine holds a finished prefill's blocks for the decode
                       engine to pull (default 30); then they are freed and a late pull is refused.

The hand-off, as NixlConnector's pull:
- the prefill request carries kv_transfer_params {"do_remote_decode": true}; when it finishes
  (max_tokens=1), `request_finished` keeps its blocks (returns True) and answers the parameters the
  proxy gives the decode request: do_remote_prefill, remote_engine_id, remote_request_id,
  remote_block_ids, remote_num_tokens, remote_host, remote_port;
- the decode engine's scheduler counts those prompt tokens as remote (`get_num_new_matched_tokens`
  returns (n, True): the request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated);
  `build_connector_meta` hands the worker which of its blocks take which remote blocks;
- the decode worker pulls them on a thread over the prefill worker's side channel
  (runtime/kv/side_channel.py: the proofs, the ask, the header and one coded frame per layer, the
  ack), writes them into its blocks, and reports the request in finished_recving (in failed_recving
  too if the pull failed: vLLM then recomputes or fails the request as kv_load_failure_policy says);
- the prefill worker reports the request in finished_sending once the decode side acknowledged,
  released it, or the lease ran out; vLLM's scheduler then frees its blocks.

Several decode requests for one prefill (a request with n > 1 choices is n requests to vLLM's
scheduler, all with the same kv_transfer_params): the first pulls, the others wait for it, then
compute the prompt locally (a prefix-cache hit on the pulled blocks, where prefix caching is on).

Tensor parallelism: both engines at the same size (a decode request whose prefill ran at another size
is computed locally, with a WARNING); rank r of the decode engine pulls rank r's heads from rank r
of the prefill engine, whose side channel listens on port + r. MLA (DeepSeek-V3, Kimi K2.5): the
latent cache (kv_lora_rank + rope dims a token, one row per token, replicated on every rank) moves
the same way, as one head.

vLLM-CPU's attention kernel packs K inside a block for its ISA: the worker learns which token each
element of a block holds from the kernel itself (`_token_of`), so a pull moves exactly the prompt's
tokens, and two engines whose kernels lay blocks out differently refuse to pair.

A side-channel peer that fails its proof, or asks for a request, blocks or tokens the engine does
not hold for it, is refused with a WARNING and changes nothing.
"""

from __future__ import annotations

import collections
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.unweight.kv_connector")  # under vLLM's logger: its handler, level and format

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_CONNECTIONS = 64  # side-channel connections a prefill worker answers at once
HELD_WAIT_S = 20.0  # under the side channel's 30 s timeouts
PULLED_KEPT = 4096  # remote requests a decode engine remembers having pulled (for their sibling requests)


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
class UnweightConnectorMetadata(KVConnectorMetadata):
    sends: dict[str, Send] = field(default_factory=dict)
    recvs: dict[str, Recv] = field(default_factory=dict)


@dataclass(frozen=True)
class Remote:
    """A decode request's kv_transfer_params, as a prefill engine's connector answers them."""

    request_id: str
    host: str
    port: int
    block_ids: list[int]
    tokens: int
    tp: int

    @classmethod
    def of(cls, p: dict) -> Remote:
        """KeyError, TypeError or ValueError naming what is missing or wrong."""
        ids = _flat(p["remote_block_ids"])
        port, tokens, tp = p["remote_port"], p.get("remote_num_tokens"), p.get("tp_size", 1)
        checks = {
            "remote_request_id": isinstance(p["remote_request_id"], str) and 0 < len(p["remote_request_id"]) <= 256,
            "remote_host": isinstance(p["remote_host"], str) and 0 < len(p["remote_host"]) <= 255,
            "remote_port": _int(port) and 0 < port < 65536,
            "remote_block_ids": all(_int(b) and b >= 0 for b in ids),
            "remote_num_tokens": _int(tokens) and 0 <= tokens <= (len(ids) + 1) * (1 << 16),
            "tp_size": _int(tp) and tp >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"{', '.join(bad)} not as a prefill engine answers them")
        return cls(p["remote_request_id"], p["remote_host"], port, ids, tokens, tp)

    def recv(self, first: int, local: list[int], tokens: int) -> Recv:
        """The pull of `tokens` tokens from remote block `first` on into `local` (none: a release)."""
        remote = self.block_ids[first : first + len(local)] if local else self.block_ids
        return Recv(self.request_id, self.host, self.port, first, remote, local, tokens)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class UnweightConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        from unweight.runtime.kv.secret import connector_key, read_secret_file

        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = cfg.engine_id
        self.host = str(cfg.get_from_extra_config("host", "127.0.0.1"))
        self.port = int(cfg.get_from_extra_config("port", 0))
        self.lease_s = float(cfg.get_from_extra_config("kv_lease_duration", 30))
        self.compression = str(cfg.get_from_extra_config("kv_compression", "on"))
        if self.compression not in ("on", "off"):
            raise ValueError(f"UnweightConnector kv_compression {self.compression!r} is not 'on' or 'off'")
        secret_file = cfg.get_from_extra_config("secret_file", None)
        self.key = connector_key(read_secret_file(secret_file)) if secret_file else None
        if cfg.is_kv_producer and not self.port:
            raise ValueError("UnweightConnector as kv_producer needs kv_connector_extra_config 'port'")
        if self.key is None and self.host not in LOOPBACK:
            raise ValueError(
                f"UnweightConnector on {self.host}, not loopback, needs kv_connector_extra_config 'secret_file': "
                "without it every prompt's KV cache would cross the network unauthenticated and in clear"
            )
        # scheduler side
        self._sends: dict[str, Send] = {}
        self._recvs: dict[str, Recv] = {}
        self._matched: dict[str, int] = {}  # request id -> the local tokens get_num_new_matched_tokens saw
        self._pulling: dict[str, str] = {}  # remote request id -> the local request pulling it
        self._pulled: collections.OrderedDict[str, None] = collections.OrderedDict()  # remote ids pulled here
        # worker side
        self._worker = _Worker(self, vllm_config) if role == KVConnectorRole.WORKER else None

    # ---- scheduler side -------------------------------------------------------------------------

    def _remote(self, request: Request) -> Remote | None:
        """The prefill a decode request's kv_transfer_params name, checked (they come with the request,
        from whoever sent it); None, with a WARNING and the prompt computed here, if they are not what
        a prefill engine's UnweightConnector answers, or it ran at another tensor-parallel size."""
        params = request.kv_transfer_params
        try:
            remote = Remote.of(params)
        except (KeyError, TypeError, ValueError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else str(e)
            log.warning(
                "request %s: kv_transfer_params refused (%s); the prompt is computed here", request.request_id, why
            )
            params["do_remote_prefill"] = False
            return None
        if remote.tp != self.tp:
            log.warning(
                "request %s: the prefill engine runs at tensor_parallel_size %d, this one at %d: UnweightConnector "
                "pairs equal sizes only; the prompt is computed here",
                request.request_id,
                remote.tp,
                self.tp,
            )
            params["do_remote_prefill"] = False
            return None
        return remote

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return 0, False
        remote = self._remote(request)
        if remote is None:
            return 0, False
        remote_rid = remote.request_id
        if self._pulling.get(remote_rid, request.request_id) != request.request_id:
            return None, False  # a sibling (another of n choices) is pulling this prefill: ask again later
        if remote_rid in self._pulled:  # a sibling pulled it: the prompt is computed here (prefix-cache hits)
            params["do_remote_prefill"] = False
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        count = min(remote.tokens, len(request.prompt_token_ids or ())) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return
        remote = self._remote(request)
        params["do_remote_prefill"] = False  # one pull per request
        if remote is None:
            return
        local_tokens = self._matched.pop(request.request_id, 0)
        first = local_tokens // self.block_size
        last = math.ceil((local_tokens + num_external_tokens) / self.block_size)
        local = list(blocks.get_block_ids()[0][first:last]) if num_external_tokens > 0 else []
        self._recvs[request.request_id] = remote.recv(first, local, num_external_tokens)
        if local:
            self._pulling[remote.request_id] = request.request_id

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = UnweightConnectorMetadata(sends=self._sends, recvs=self._recvs)
        self._sends, self._recvs = {}, {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        done = connector_output.finished_recving or ()
        for remote_rid in [r for r, local in self._pulling.items() if local in done]:
            del self._pulling[remote_rid]
            self._pulled[remote_rid] = None
            while len(self._pulled) > PULLED_KEPT:
                self._pulled.popitem(last=False)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._matched.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode request that ended before its pull: release the blocks
            remote = self._remote(request)
            params["do_remote_prefill"] = False
            if remote is not None and remote.request_id not in self._pulled:
                self._recvs[request.request_id] = remote.recv(0, [], 0)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing to hand off
        if not block_ids:
            return False, None
        tokens = request.num_computed_tokens
        self._sends[request.request_id] = Send(list(block_ids), tokens, self.lease_s)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": tokens,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp,
        }

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: the prefills this step hands over are held (and servable) from
        now, not from start_load_kv, which vLLM calls after the forward when no load is synchronous:
        a pull would otherwise wait for a whole forward of other prompts."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, UnweightConnectorMetadata)
        self._worker.hold(connector_metadata.sends)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UnweightConnectorMetadata)
        self._worker.start(meta.recvs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the producer serves a prefill's blocks once it finished (layer streaming: later)

    def wait_for_save(self):
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()


def _flat(block_ids) -> list:
    """NixlConnector sends block ids per KV cache group ([[...]]); ours are one group's list."""
    if not isinstance(block_ids, (list, tuple)):
        raise TypeError(f"remote_block_ids is {type(block_ids).__name__}, not a list")
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise ValueError(f"{len(block_ids)} KV cache groups: UnweightConnector takes one")
        return list(block_ids[0])
    return list(block_ids)


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


class _Worker:
    """The worker process's half: the KV caches, the side-channel server (producer) and the pulls
    (consumer). Threads hand their results to the engine's step through `results` under a lock."""

    def __init__(self, connector: UnweightConnector, vllm_config: VllmConfig):
        self.c, self.vllm_config = connector, vllm_config
        self.rank = 0  # of tensor parallelism, known once the caches are registered
        self.caches: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.held: dict[str, tuple[Send, float]] = {}  # request id -> (what, monotonic deadline)
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
            shaped = t.dim() == 4 and t.is_contiguous() and t.shape[2] == self.c.block_size and t.shape[3] % 2 == 0
            if not shaped or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(
                    f"UnweightConnector: KV cache of {name} is {list(t.shape)} (strides {t.stride()}), "
                    f"{t.dtype}, not (blocks, kv_heads, {self.c.block_size}, 2 * head_dim) contiguous "
                    "in BF16, FP16 or FP32"
                )
        self.caches = list(kv_caches.values())
        t = self.caches[0]
        heads, dim = t.shape[1], t.shape[3] // 2
        if mla:  # the backend writes token i's latent as row i of the block (cpu_mla.py do_kv_cache_update)
            token_of = torch.arange(self.c.block_size).repeat_interleave(2 * dim)
        else:
            token_of = _token_of(self.vllm_config, t.dtype, heads, dim)
        self.layout = Layout(len(self.caches), heads, dim, t.dtype, self.c.block_size, token_of)
        self._warm()
        if self.c._kv_transfer_config.is_kv_producer:
            self._serve()

    def _warm(self) -> None:
        """The codec's kernels compiled (or loaded from numba's cache) now, not inside the first pull's
        timeouts."""
        from unweight.runtime.kv import wire

        sample = torch.randn(2, 64, self.layout.heads, self.layout.dim).to(self.layout.dtype)  # codes smaller: rans
        wire.decode_layer(wire.encode_layer(sample, True), torch.empty_like(sample))

    # ---- the engine's step ----

    def hold(self, sends: dict[str, Send]) -> None:
        """Finished prefills whose blocks the engine keeps for the decode side, each until its lease ends."""
        if not sends:
            return
        now = time.monotonic()
        with self.lock:
            for rid, send in sends.items():
                self.held[rid] = (send, now + send.lease_s)
            self.arrived.notify_all()

    def start(self, recvs: dict[str, Recv]) -> None:
        """The pulls this step asks for, each on a thread of its own."""
        for rid, recv in recvs.items():
            threading.Thread(target=self._pull, args=(rid, recv), name=f"kv-pull-{rid}", daemon=True).start()

    def results(self) -> KVConnectorTransferResults:
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, (_, deadline) in self.held.items() if now >= deadline]:
                log.warning("request %s: no decode engine pulled its KV within its lease; its blocks are freed", rid)
                self._free(rid)
            out = KVConnectorTransferResults(self.done_sending, self.done_recving, self.failed_recving)
            self.done_sending, self.done_recving, self.failed_recving = set(), set(), set()
        return out

    # ---- consumer: pull ----

    def _pull(self, rid: str, r: Recv) -> None:
        from unweight.runtime.kv import side_channel

        ok = False
        try:
            if self.c.key is None and r.host not in LOOPBACK:
                raise side_channel.Refused(
                    f"the prefill engine is on {r.host}, not loopback, and this engine has no secret_file"
                )
            ask = {"request_id": r.remote_request_id, "blocks": r.remote_block_ids, "first_block": r.first_block}
            ask |= {"tokens": r.tokens, "release": not r.local_block_ids, "compress": self.c.compression == "on"}
            sent, received = side_channel.pull(
                (r.host, r.port + self.rank), self.c.key, ask, self.layout, self.caches, r.local_block_ids
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
                    "sealed" if self.c.key else "unsealed (loopback)",
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
        self.server = socket.create_server((self.c.host, self.c.port + self.rank), reuse_port=False)
        threading.Thread(target=self._accept, name="kv-side-channel", daemon=True).start()
        log.info(
            "UnweightConnector: serving KV on %s:%d (%s)",
            self.c.host,
            self.c.port + self.rank,
            "peers prove the secret, frames sealed" if self.c.key else "loopback, no secret: frames unsealed",
        )

    def _accept(self) -> None:
        """One thread a connection, MAX_CONNECTIONS at once: a connection past them is closed at once
        (peers that connect and say nothing would otherwise hold a thread each for the timeout)."""
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
                ask = side_channel.serve(conn, self.c.key, self._check, self.layout, self.caches)
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
        """The request's blocks go back to the engine (under the lock)."""
        del self.held[rid]
        self.done_sending.add(rid)
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
        send, first, blocks = held[0], ask.get("first_block"), ask.get("blocks")
        if not isinstance(first, int) or not isinstance(blocks, list) or not blocks or first < 0:
            return f"request {rid}: blocks {blocks!r} at {first!r} are not a list of block ids at an index"
        if blocks != send.block_ids[first : first + len(blocks)]:
            return f"request {rid}: blocks {blocks} at {first} are not this request's"
        tokens, size = ask.get("tokens"), self.c.block_size
        if not isinstance(tokens, int) or not (
            (len(blocks) - 1) * size < tokens <= min(len(blocks) * size, send.tokens - first * size)
        ):
            return f"request {rid}: {tokens!r} tokens are not what its {len(blocks)} blocks from block {first} hold"
        return None

    def close(self) -> None:
        self.closed.set()
        if self.server is not None:
            self.server.close()
