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
    kv_lease_duration  seconds a prefill engine holds a finished prefill's blocks, or its coded
                       frames, for the decode engine to pull (default 30); then they are freed and a
                       late pull is refused.
    kv_stage_bytes     the raw KV bytes of finished prefills a prefill engine's worker may hold coded
                       in host memory at once, waiting for their pulls (default 1 GiB; 0: none, each
                       layer is coded from the blocks as it is pulled).

The hand-off, as NixlConnector's pull:
- the prefill request carries kv_transfer_params {"do_remote_decode": true}; in the step whose
  forward completes its prompt, `save_kv_layer` copies each layer's share of the prompt out of the
  cache as the forward leaves that layer, and a thread of its own codes it (runtime/kv/side_channel.py
  `Stage`) while the forward goes on; once every layer is coded the engine gets the blocks back
  (finished_sending), and pulls are served from the frames (within kv_stage_bytes; past it, or if
  a layer was not saved, the blocks stay held and are coded as they are pulled);
- when the prefill request finishes (max_tokens=1), `request_finished` keeps its blocks (returns
  True) and answers the parameters the proxy gives the decode request: do_remote_prefill,
  remote_engine_id, remote_request_id, remote_block_ids, remote_num_tokens, remote_host, remote_port;
- the decode engine's scheduler counts those prompt tokens as remote (`get_num_new_matched_tokens`
  returns (n, True): the request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated);
  `build_connector_meta` hands the worker which of its blocks take which remote blocks;
- the decode worker pulls them on a thread over the prefill worker's side channel
  (runtime/kv/side_channel.py: the proofs, the ask, the header and one coded frame per layer, the
  ack), writes them into its blocks, and reports the request in finished_recving (in failed_recving
  too if the pull failed: vLLM then recomputes or fails the request as kv_load_failure_policy says);
- the prefill worker reports the request in finished_sending once its frames are coded, or else
  once the decode side acknowledged, released it, or the lease ran out; vLLM's scheduler then frees
  its blocks. The frames stay until the decode side acknowledged them, or the lease ran out.

The layers cross only when the decode engine pulls, after the prefill answered: the handshake is
NixlConnector's, in which the decode engine and its blocks are not known before. What overlaps the
prefill's forward is the coding (tens of MB/s a thread on a Zen 1, about a hundred on a Zen 5).

Several decode requests for one prefill (a request with n > 1 choices is n requests to vLLM's
scheduler, all with the same kv_transfer_params): the first pulls, the others wait for it, then
compute the prompt locally (a prefix-cache hit on the pulled blocks, where prefix caching is on).

Tensor parallelism: both engines at the same size (a decode request whose prefill ran at another size
is computed locally, with a WARNING); rank r of the decode engine pulls rank r's heads from rank r
of the prefill engine, whose side channel listens on port + r. MLA (DeepSeek-V3, Kimi K2.5): the
latent cache (kv_lora_rank + rope dims a token, one row per token, replicated on every rank) moves
the same way, as one head.

vLLM-CPU's attention kernel packs K inside a block for its ISA: the worker learns which token each
element of a block holds from the kernel itself (kv_worker.py `_token_of`), so a pull moves exactly the prompt's
tokens, and two engines whose kernels lay blocks out differently refuse to pair.

A side-channel peer that fails its proof, or asks for a request, blocks or tokens the engine does
not hold for it, is refused with a WARNING and changes nothing.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .kv_worker import PULLED_KEPT, KVWorker, Recv, Save, Send, Settings, log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class Producing:
    """A prefill for a decode engine, while its prompt is computed: its prompt's length and the
    blocks allocated so far."""

    prompt: int
    blocks: list[int] = field(default_factory=list)


@dataclass
class UnweightConnectorMetadata(KVConnectorMetadata):
    sends: dict[str, Send] = field(default_factory=dict)
    recvs: dict[str, Recv] = field(default_factory=dict)
    saves: dict[str, Save] = field(default_factory=dict)
    drops: set[str] = field(default_factory=set)  # staged prefills that ended without a hand-off


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
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.engine_id = self._kv_transfer_config.engine_id
        self.settings = s = Settings.of(vllm_config)  # ValueError naming a bad key
        self.block_size = s.block_size
        # scheduler side
        self._sends: dict[str, Send] = {}
        self._recvs: dict[str, Recv] = {}
        self._matched: dict[str, int] = {}  # request id -> the local tokens get_num_new_matched_tokens saw
        self._pulling: dict[str, str] = {}  # remote request id -> the local request pulling it
        self._pulled: collections.OrderedDict[str, None] = collections.OrderedDict()  # remote ids pulled here
        self._producing: dict[str, Producing] = {}  # prefills for a decode engine, their prompt not yet done
        self._staged: set[str] = set()  # prefills whose layers a forward saved, not yet finished
        self._drops: set[str] = set()
        # worker side
        self._worker = KVWorker(s, vllm_config) if role == KVConnectorRole.WORKER else None

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
        if params and params.get("do_remote_decode") and self.settings.producer:
            self._producing[request.request_id] = Producing(len(request.prompt_token_ids or ()))
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
        saves = self._saves(scheduler_output) if self._producing else {}
        meta = UnweightConnectorMetadata(sends=self._sends, recvs=self._recvs, saves=saves, drops=self._drops)
        self._sends, self._recvs, self._drops = {}, {}, set()
        return meta

    def _saves(self, out: SchedulerOutput) -> dict[str, Save]:
        """The prefills for a decode engine whose prompt this step completes, with their blocks (new
        requests and resumed ones list them all, running ones the blocks added this step)."""
        steps = [(r.req_id, r.block_ids[0], r.num_computed_tokens, True) for r in out.scheduled_new_reqs]
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            ids = c.new_block_ids[i]
            steps.append((rid, ids[0] if ids else [], c.num_computed_tokens[i], rid in c.resumed_req_ids))
        saves = {}
        for rid, ids, computed, whole in steps:
            p = self._producing.get(rid)
            if p is None:
                continue
            p.blocks = list(ids) if whole else p.blocks + list(ids)
            if computed + out.num_scheduled_tokens.get(rid, 0) >= p.prompt > 0:
                del self._producing[rid]
                self._staged.add(rid)
                saves[rid] = Save(p.blocks[: math.ceil(p.prompt / self.block_size)], p.prompt)
        return saves

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        done = connector_output.finished_recving or ()
        for remote_rid in [r for r, local in self._pulling.items() if local in done]:
            del self._pulling[remote_rid]
            self._pulled[remote_rid] = None
            while len(self._pulled) > PULLED_KEPT:
                self._pulled.popitem(last=False)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._producing.pop(request.request_id, None)
        handed_off, answer = self._hand_off(request, block_ids)
        if request.request_id in self._staged:
            self._staged.discard(request.request_id)
            if not handed_off:
                self._drops.add(request.request_id)
        return handed_off, answer

    def _hand_off(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

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
        self._sends[request.request_id] = Send(list(block_ids), tokens, self.settings.lease_s)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": tokens,
            "remote_host": self.settings.host,
            "remote_port": self.settings.port,
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
        self._worker.drop(connector_metadata.drops)
        self._worker.hold(connector_metadata.sends)
        self._worker.stage(connector_metadata.saves)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UnweightConnectorMetadata)
        self._worker.start(meta.recvs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker.saving:
            self._worker.save(layer_name)

    def wait_for_save(self):
        if self._worker.saving:
            self._worker.saved()

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
