"""UnweightConnector: a vLLM v1 KV connector that moves a prefill engine's KV cache to a decode engine
coded losslessly with the project's KV codec (runtime/kv/wire.py), speaking NixlConnector's
`kv_transfer_params` handshake, so vLLM's proxies and routers drive it unchanged. Prototype: tensor
parallel size 1, one host (loopback; frames carry their CRC-32, not a seal), attention caches of
(blocks, kv_heads, block_size, 2 * head_dim) as vLLM-CPU lays them out (not MLA yet).

    vllm serve DIR --kv-transfer-config '{"kv_connector":"UnweightConnector",
        "kv_connector_module_path":"unweight.runtime.vllm.kv_connector","kv_role":"kv_producer",
        "kv_connector_extra_config":{"host":"127.0.0.1","port":P}}'     (kv_consumer: the decode side)

The hand-off, as NixlConnector's pull:
- the prefill request carries kv_transfer_params {"do_remote_decode": true}; when it finishes
  (max_tokens=1), `request_finished` keeps its blocks (returns True) and answers the parameters the
  proxy gives the decode request: do_remote_prefill, remote_engine_id, remote_request_id,
  remote_block_ids, remote_num_tokens, remote_host, remote_port;
- the decode engine's scheduler counts those prompt tokens as remote (`get_num_new_matched_tokens`
  returns (n, True): the request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated);
  `build_connector_meta` hands the worker which of its blocks take which remote blocks;
- the decode worker pulls them on a thread from the prefill worker's side channel (a TCP server on
  host:port): a request, then kv_wire's header and one frame per layer, the layer's blocks byte for
  byte (the CPU kernel packs K inside a block: whole blocks, not tokens) in the cache's dtype,
  rans-coded where that is smaller; it writes them into its blocks, acknowledges, and reports the
  request in finished_recving (failed_recving too if the pull failed: vLLM then recomputes or
  fails the request as kv_load_failure_policy says);
- the prefill worker reports the request in finished_sending once the decode side acknowledged,
  released it, or the lease (`kv_lease_duration` in kv_connector_extra_config, default 30 s) ran
  out; vLLM's scheduler then frees its blocks.

A side-channel request for a request id the worker does not hold, or for blocks and token counts
it does not hold for it, is refused with a WARNING and changes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
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
    from vllm.v1.request import Request

log = logging.getLogger("vllm.unweight.kv_connector")  # under vLLM's logger: its handler, level and format

LENGTH = struct.Struct("<I")  # before every message and frame on the side channel
MAX_REQUEST_BYTES = 1 << 20  # a pull request's JSON (block ids of a 512k-token prompt fit)
IO_TIMEOUT_S = 30.0
ACK = b"\x01"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


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


REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port")


class UnweightConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"UnweightConnector runs at tensor_parallel_size 1 for now, not {tp}")
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            raise ValueError("UnweightConnector does not move MLA latent caches yet")
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = cfg.engine_id
        self.host = str(cfg.get_from_extra_config("host", "127.0.0.1"))
        self.port = int(cfg.get_from_extra_config("port", 0))
        self.lease_s = float(cfg.get_from_extra_config("kv_lease_duration", 30))
        if cfg.is_kv_producer and not self.port:
            raise ValueError("UnweightConnector as kv_producer needs kv_connector_extra_config 'port'")
        if cfg.is_kv_producer and self.host not in LOOPBACK:
            raise ValueError(f"UnweightConnector host {self.host!r}: only loopback for now (frames are not sealed yet)")
        # scheduler side
        self._sends: dict[str, Send] = {}
        self._recvs: dict[str, Recv] = {}
        self._matched: dict[str, int] = {}  # request id -> the local tokens get_num_new_matched_tokens saw
        # worker side
        self._worker = _Worker(self) if role == KVConnectorRole.WORKER else None

    # ---- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill") and all(k in params for k in REMOTE_KEYS)):
            return 0, False
        remote = min(int(params.get("remote_num_tokens") or 0), len(request.prompt_token_ids or ()))
        self._matched[request.request_id] = num_computed_tokens
        count = remote - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # one pull per request
        if not all(k in params for k in REMOTE_KEYS):
            log.warning("request %s: kv_transfer_params lack %s", request.request_id, REMOTE_KEYS)
            return
        local_tokens = self._matched.pop(request.request_id, 0)
        first = local_tokens // self.block_size
        last = math.ceil((local_tokens + num_external_tokens) / self.block_size)
        local = list(blocks.get_block_ids()[0][first:last]) if num_external_tokens > 0 else []
        self._recvs[request.request_id] = self._recv(params, first, local, num_external_tokens)

    def _recv(self, params: dict, first: int, local: list[int], tokens: int) -> Recv:
        remote = [int(b) for b in _flat(params["remote_block_ids"])]
        return Recv(
            str(params["remote_request_id"]),
            str(params["remote_host"]),
            int(params["remote_port"]),
            first,
            remote[first : first + len(local)] if local else remote,
            local,
            tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = UnweightConnectorMetadata(sends=self._sends, recvs=self._recvs)
        self._sends, self._recvs = {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode request that ended before its pull: release the blocks
            params["do_remote_prefill"] = False
            if all(k in params for k in REMOTE_KEYS):
                self._recvs[request.request_id] = self._recv(params, 0, [], 0)
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
            "tp_size": 1,
        }

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UnweightConnectorMetadata)
        self._worker.start(meta)

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
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise ValueError(f"{len(block_ids)} KV cache groups: UnweightConnector takes one")
        return list(block_ids[0])
    return list(block_ids)


class _Worker:
    """The worker process's half: the KV caches, the side-channel server (producer) and the pulls
    (consumer). Threads hand their results to the engine's step through `results` under a lock."""

    def __init__(self, connector: UnweightConnector):
        self.c = connector
        self.caches: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.held: dict[str, tuple[Send, float]] = {}  # request id -> (what, monotonic deadline)
        self.done_sending: set[str] = set()
        self.done_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.server: socket.socket | None = None
        self.closed = threading.Event()

    # layout: each layer one contiguous (blocks, kv_heads, block_size, 2 * head_dim) tensor. Inside a
    # block the order is the CPU attention kernel's own: per head, block_size rows of K then of V
    # (CPUAttentionBackendImpl splits it so), V token-major but K packed for the kernel's ISA (a
    # token's K is not a row). So whole blocks move, byte for byte, whatever the kernel's layout; a
    # layer's frame is its blocks' bytes as kv_wire's (2, block_size * blocks, kv_heads, head_dim).
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        self.dtype = t.dtype
        self.heads, self.dim = t.shape[1], t.shape[3] // 2
        if self.c._kv_transfer_config.is_kv_producer:
            self._serve()

    def gather(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """The layer's blocks, as kv_wire sends a layer: (2, block_size * blocks, kv_heads, head_dim)."""
        return self.caches[layer][torch.tensor(block_ids)].view(2, -1, self.heads, self.dim)

    def scatter(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        """Write what `gather` gave on the other side into this engine's `block_ids`."""
        t = self.caches[layer]
        t[torch.tensor(block_ids)] = data.view(len(block_ids), *t.shape[1:])

    def shape(self, blocks: int) -> tuple[int, ...]:
        return (len(self.caches), 2, blocks * self.c.block_size, self.heads, self.dim)

    # ---- the engine's step ----

    def start(self, meta: UnweightConnectorMetadata) -> None:
        now = time.monotonic()
        with self.lock:
            for rid, send in meta.sends.items():
                self.held[rid] = (send, now + send.lease_s)
        for rid, recv in meta.recvs.items():
            threading.Thread(target=self._pull, args=(rid, recv), name=f"kv-pull-{rid}", daemon=True).start()

    def results(self) -> KVConnectorTransferResults:
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, (_, deadline) in self.held.items() if now >= deadline]:
                log.warning("request %s: no decode engine pulled its KV within its lease; its blocks are freed", rid)
                del self.held[rid]
                self.done_sending.add(rid)
            out = KVConnectorTransferResults(self.done_sending, self.done_recving, self.failed_recving)
            self.done_sending, self.done_recving, self.failed_recving = set(), set(), set()
        return out

    # ---- consumer: pull ----

    def _pull(self, rid: str, r: Recv) -> None:
        from unweight.runtime.kv import wire as kv_wire

        ok = False
        try:
            with socket.create_connection((r.host, r.port), timeout=IO_TIMEOUT_S) as s:
                ask = {"request_id": r.remote_request_id, "blocks": r.remote_block_ids, "first_block": r.first_block}
                ask |= {"tokens": r.tokens, "release": not r.local_block_ids, "layers": len(self.caches)}
                ask |= {"heads": self.heads, "head_dim": self.dim, "dtype": str(self.dtype).removeprefix("torch.")}
                _send_msg(s, json.dumps(ask).encode())
                answer = json.loads(_recv_msg(s, MAX_REQUEST_BYTES))
                if not answer.get("ok"):
                    raise kv_wire.WireError(f"the prefill engine refused: {answer.get('error')}")
                if r.local_block_ids:
                    wire = self._receive(s, r, kv_wire)
                    s.sendall(ACK)
                    log.info(
                        "UnweightConnector: pulled %d tokens of request %s in %d blocks "
                        "(%d layers, %d bytes on the wire, %d raw)",
                        r.tokens,
                        r.remote_request_id,
                        len(r.local_block_ids),
                        len(self.caches),
                        wire,
                        math.prod(self.shape(len(r.local_block_ids))) * self.caches[0].element_size(),
                    )
            ok = True
        except Exception as e:  # noqa: BLE001 (a thread's end: whatever went wrong, the scheduler must hear of it)
            log.warning("UnweightConnector: pulling the KV of request %s failed: %s", r.remote_request_id, e)
        with self.lock:
            if r.local_block_ids:
                self.done_recving.add(rid)
                if not ok:
                    self.failed_recving.add(rid)

    def _receive(self, s: socket.socket, r: Recv, kv_wire) -> int:
        shape = self.shape(len(r.local_block_ids))
        header = _recv_msg(s, kv_wire.HEADER.size + kv_wire.RID_MAX)
        kv_wire.check_header(header, r.remote_request_id, 0, self.dtype, shape, need_sealed=False)
        bound = kv_wire.max_frame_bytes(shape, self.dtype, sealed=False)
        out = torch.empty(shape[1:], dtype=self.dtype)
        wire = LENGTH.size + len(header)
        for layer in range(len(self.caches)):
            data = _recv_msg(s, bound)
            wire += LENGTH.size + len(data)
            kv_wire.decode_layer(kv_wire.strip_check(layer, data), out)
            self.scatter(layer, r.local_block_ids, out)
        return wire

    # ---- producer: serve ----

    def _serve(self) -> None:
        self.server = socket.create_server((self.c.host, self.c.port), reuse_port=False)
        threading.Thread(target=self._accept, name="kv-side-channel", daemon=True).start()
        log.info("UnweightConnector: serving KV on %s:%d", self.c.host, self.c.port)

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), name="kv-send", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        from unweight.runtime.kv import wire as kv_wire

        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                ask = json.loads(_recv_msg(conn, MAX_REQUEST_BYTES))
                rid, send, error = self._check(ask)
                if error:
                    log.warning("UnweightConnector: refused a pull of request %s: %s", ask.get("request_id"), error)
                    _send_msg(conn, json.dumps({"ok": False, "error": error}).encode())
                    return
                _send_msg(conn, b'{"ok": true}')
                if not ask["release"]:
                    self._frames(conn, rid, send, ask, kv_wire)
                    if conn.recv(1) != ACK:
                        raise ConnectionError("the decode engine closed before acknowledging")
            except Exception as e:  # noqa: BLE001 (a peer's request, whatever it holds, ends here with a warning)
                log.warning("UnweightConnector: a pull on the side channel failed: %s", e)
                return
        with self.lock:  # acknowledged or released: the blocks go back to the engine
            if self.held.pop(rid, None) is not None:
                self.done_sending.add(rid)

    def _check(self, ask: dict) -> tuple[str, Send | None, str | None]:
        rid = str(ask.get("request_id"))
        with self.lock:
            held = self.held.get(rid)
        if held is None:
            return rid, None, "no such request held here (unknown, already pulled, or its lease ran out)"
        send, first, blocks = held[0], int(ask.get("first_block", -1)), list(ask.get("blocks") or ())
        if ask.get("release"):
            return rid, send, None
        if first < 0 or blocks != send.block_ids[first : first + len(blocks)] or not blocks:
            return rid, None, f"blocks {blocks} at {first} are not this request's"
        tokens, size = int(ask.get("tokens", 0)), self.c.block_size
        if not (len(blocks) - 1) * size < tokens <= min(len(blocks) * size, send.tokens - first * size):
            return rid, None, f"{tokens} tokens are not what its {len(blocks)} blocks from block {first} hold"
        geometry = (ask.get("layers"), ask.get("heads"), ask.get("head_dim"), ask.get("dtype"))
        ours = (len(self.caches), self.heads, self.dim, str(self.dtype).removeprefix("torch."))
        if geometry != ours:
            return rid, None, f"cache of (layers, kv_heads, head_dim, dtype) {geometry}, this engine's is {ours}"
        return rid, send, None

    def _frames(self, conn: socket.socket, rid: str, send: Send, ask: dict, kv_wire) -> None:
        blocks = ask["blocks"]
        header = kv_wire.pack_header(rid, 0, self.dtype, self.shape(len(blocks)), False, kv_wire.new_salt())
        _send_msg(conn, header)
        for layer in range(len(self.caches)):
            frame = kv_wire.encode_layer(self.gather(layer, blocks), compress=True)
            _send_msg(conn, kv_wire.add_check(layer, frame))

    def close(self) -> None:
        self.closed.set()
        if self.server is not None:
            self.server.close()


def _send_msg(s: socket.socket, data: bytes) -> None:
    s.sendall(LENGTH.pack(len(data)) + data)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the peer closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_msg(s: socket.socket, bound: int) -> bytes:
    (n,) = LENGTH.unpack(_recv_exact(s, LENGTH.size))
    if n > bound:
        raise ValueError(f"a message of {n} bytes, over the {bound} expected")
    return _recv_exact(s, n)
