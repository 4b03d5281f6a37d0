"""A worker process of `unweight serve`: PrefillWorker, DecodeWorker, or one AggregatedWorker.

The router starts each with `python -m unweight.runtime.serve.worker`, its WorkerSpec (the whole
ServeConfig, its role, name and the router's addresses) and the control secret in the
environment; a worker on another host is started with `unweight serve --role ...`, which builds
the same WorkerSpec. Each loads the compressed model itself (its KV pool sized for its role),
opens its KV link if its role has one, connects to the router's control socket and runs its loop:
- prefill (prefill_worker.py): one prompt at a time -> first token -> KV cache sent to the decode
  worker the router chose;
- decode (decode_worker.py): continuous batching of the sequences whose KV arrived;
- aggregated (aggregated_worker.py, --no-disagg): both in one process.
What they share is worker_base.py (the control channel, jobs, the prefill phase) and batch.py (the
running batch and its KV pool). Each sequence's settings, tokens and stop decision live in its
`Sequence` (runtime/model/sampling.py), handed from prefill to decode worker whole. Token ids go
back to the router, which detokenises and streams.
"""

from __future__ import annotations

import logging
import os

import torch

from ..kv.secret import kv_link_key
from ..model.config import ModelConfig
from ..model.loader import load
from ..threads import set_threads
from .aggregated_worker import AggregatedWorker
from .decode_worker import DecodeWorker
from .kv_link import ControlStore, KVLink
from .prefill_worker import PrefillWorker
from .protocol import SECRET_ENV, SPEC_ENV, WorkerSpec, context_limits
from .worker_base import Worker

WORKERS: dict[str, type[Worker]] = {cls.ROLE: cls for cls in (PrefillWorker, DecodeWorker, AggregatedWorker)}


def build(spec: WorkerSpec, secret: str) -> Worker:
    """The worker of `spec`'s role: its model loaded, connected to the router, its KV link open."""
    cfg, cls = spec.cfg, WORKERS[spec.role]
    # the same sizes as the router's (one function): a prefill worker holds one sequence of the
    # admitted context, a decode or aggregated worker the pool that its admission and
    # preemption keep within
    max_len, pool = context_limits(cfg, ModelConfig.from_folder(cfg.model).max_position_embeddings)
    model = load(
        cfg.model,
        cfg.device,
        max_cache_tokens=cls.cache_tokens(max_len, pool),
        kv_cache_dtype=cfg.kv_cache_dtype,
        dtype=cfg.dtype,
    )
    worker = cls(spec, model, max_len, secret=secret)
    if cls.LINK_RANK is not None:
        open_link(worker, spec, secret)
    return worker


def open_link(worker: Worker, spec: WorkerSpec, secret: str) -> None:
    """The worker's KV link, its rendezvous over a control socket of its own, made when first needed."""
    worker.kv_store = ControlStore(worker._kv_socket)
    worker.link = KVLink(
        worker.kv_store,
        kv_link_key(secret),
        worker.incarnation,
        worker.LINK_RANK,
        local_address_towards(spec.router[0]),
        compression=spec.cfg.kv_compression,
        encryption=spec.cfg.kv_encryption,
    )


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
    build(spec, secret).run()


if __name__ == "__main__":  # how the router starts its workers: the spec and the secret in the environment
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    main(WorkerSpec.from_json(os.environ.pop(SPEC_ENV)), os.environ.pop(SECRET_ENV))
