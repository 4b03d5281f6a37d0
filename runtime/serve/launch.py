"""Starting `unweight serve` in one of its roles: the router with the workers it starts (`all`), the
router alone, or a worker started by hand that joins a router elsewhere.

`launch` is what the CLI calls with its flags; every refusal is a ValueError whose message names the
flag, before anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..kv.secret import read_secret_file
from .protocol import ROLES, ServeConfig, WorkerSpec, parse_address


def launch(
    model: str | os.PathLike,
    *,
    role: str = "all",
    name: str | None = None,
    router_address: str | None = None,
    **settings,
) -> None:
    """Serve `model` in `role` (all, router, prefill, decode or worker) until SIGINT/SIGTERM.
    `settings` are ServeConfig's fields; `name` and `router_address` (HOST:PORT) are a worker's."""
    if role not in ("all", *ROLES):
        raise ValueError(f"role {role!r} is not one of all, {', '.join(ROLES)}")
    if not Path(model).is_dir():
        raise ValueError(f"{model}: no such model folder")
    cfg = ServeConfig(model=str(model), **settings)
    if cfg.control_secret_file:
        read_secret_file(cfg.control_secret_file)  # a clear error now, not from inside a process
    if role in ("all", "router"):
        if role == "router":
            if not cfg.control_secret_file:
                raise ValueError(
                    "--role router needs --control-secret-file PATH: the workers started elsewhere authenticate "
                    "with the same file"
                )
            cfg.prefill_workers = cfg.decode_workers = 0
        serve(cfg)
        return
    if router_address is None:
        raise ValueError(f"--role {role} needs --router-address HOST:PORT")
    run_worker(role, name or f"{role}-{os.getpid()}", cfg, parse_address(router_address, "--router-address"), None)


def serve(cfg: ServeConfig) -> None:
    """Run the router and (unless they live elsewhere) its workers until SIGINT/SIGTERM."""
    import uvicorn

    from .app import create_app
    from .http import guarded_protocol

    app = create_app(cfg)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        timeout_graceful_shutdown=10,
        http=guarded_protocol(cfg.timeout_header, cfg.limit_concurrency),
        timeout_keep_alive=cfg.timeout_keep_alive,
    )


def run_worker(role: str, name: str, cfg: ServeConfig, router_address: tuple[str, int], parent_pid: int | None) -> None:
    """A worker started by hand (`unweight serve --role prefill|decode|worker`), its control secret
    from --control-secret-file. (The router starts its own workers without the CLI, with the same
    WorkerSpec.)"""
    from .worker import main

    if not cfg.control_secret_file:
        raise ValueError(f"--role {role} needs --control-secret-file PATH (the file the router was given)")
    spec = WorkerSpec(
        cfg=cfg, role=role, name=name, router=router_address, parent_pid=parent_pid, threads=cfg.worker_threads
    )
    main(spec, read_secret_file(cfg.control_secret_file))


__all__ = ["launch", "run_worker", "serve"]
