"""`unweight` commands: thin typer functions, one library call each, errors as one-line messages."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

import unweight
from unweight.defaults import DEFAULT_CHUNK, DEFAULT_PRECISION, PRECISION_RANGE
from unweight.errors import UnweightError
from unweight.folder import MEMBERS_NAME

from .render import safe

app = typer.Typer(
    name="unweight",
    help="Lossless compression of LLM checkpoints: smaller files, bit-exact weights.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=None if sys.stdout.isatty() else 200)  # pipes get full rows, not 80 columns
err = Console(stderr=True)

Threads = Annotated[int | None, typer.Option("--threads", "-t", min=0, help="CPU threads (default: all; 0 = all).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4G', '512MiB', '1e9' or '1073741824' -> bytes (K, M, G, T are powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in SIZE_UNITS and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size such as 4G, 512M or 1073741824") from None
    if not value > 0:
        raise typer.BadParameter(f"{text!r} is not a positive size")
    return int(value * SIZE_UNITS[unit])


MaxMemory = Annotated[
    int | None,
    typer.Option(
        "--max-memory",
        parser=parse_size,
        metavar="SIZE",
        help="Memory budget (e.g. 4G): verify, inspect and decompress work within it in pieces; compress refuses, "
        "naming it, a tensor that would need more.",
    ),
]

EXIT_FAILED = 1  # bad input, corrupt file, or verification found a difference
# Interrupted: 128 + the signal's number (Ctrl-C 130, SIGTERM 143, SIGHUP 129), as shells report it.


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (what `timeout`, docker, systemd and a closed terminal send), raised like
    Ctrl-C so that the library removes its partial output on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, frame) -> None:
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # a second signal must not cut the clean-up short
    raise Terminated(signum)


def _run(fn: Callable[[], int | None], writes: bool = False, kernels: bool = False) -> None:
    """Run a command body, turning library errors into one line on stderr and an exit code.
    With `writes`, SIGTERM and SIGHUP interrupt it as Ctrl-C does (partial output removed, exit
    128 + the signal's number). With `kernels`, the CPU kernels are compiled first if they are not
    yet (one line says so)."""
    if writes:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, _raise_terminated)
    try:
        if kernels:
            _compile_kernels()
        code = fn() or 0
    except (UnweightError, ValueError) as e:  # ValueError: FormatError, and bad option values
        err.print(f"[bold red]error:[/] {safe(e)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        err.print(f"[bold red]error:[/] {safe(where)}{safe(e.strerror or e)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        what = f"interrupted ({signal.Signals(signum).name})"
        err.print(f"{what}: partial output was removed" if writes else what, highlight=False)
        raise typer.Exit(128 + signum) from None
    raise typer.Exit(code)


def _compile_kernels() -> None:
    from unweight.runtime import warmup

    try:
        warmup.ensure_compiled(lambda line: err.print(line, highlight=False, soft_wrap=True))
    except Exception as e:  # noqa: BLE001 - the command compiles what it needs as it runs
        err.print(f"unweight: compiling ahead failed ({safe(e)}); the kernels compile as they run", highlight=False)


def _print_json(obj) -> None:
    """JSON on stdout as is (rich's print_json parses it again and highlights it token by token,
    which took 85 s for inspect's 100k tensors): an object indented, a list one item to a line (the
    indenting encoder is pure Python, and a list of 100k tensors reads best a line each)."""
    if isinstance(obj, list):
        items = ",\n".join(json.dumps(item, ensure_ascii=False) for item in obj)
        sys.stdout.write(f"[\n{items}\n]\n" if obj else "[]\n")
    else:
        sys.stdout.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _progress(verb: str, quiet: bool):
    from .render import BarProgress

    return BarProgress(err, verb, enabled=not quiet and err.is_terminal)


@app.command()
def compress(
    src: Annotated[str, typer.Argument(help="Local model folder, .safetensors file, or Hub repo id (org/name).")],
    dst: Annotated[Path, typer.Argument(help="Output folder (must not exist).")],
    revision: Annotated[
        str | None, typer.Option(help="Hub revision (branch, tag or commit) when SRC is a repo id.")
    ] = None,
    threads: Threads = None,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Decode every tensor again before writing it.")
    ] = True,
    precision: Annotated[
        int, typer.Option(min=PRECISION_RANGE[0], max=PRECISION_RANGE[1], help="rANS frequency precision in bits.")
    ] = DEFAULT_PRECISION,
    chunk: Annotated[
        int,
        typer.Option(
            help="Most elements per independently decodable chunk (multiple of 8); tensors are cut into a multiple of "
            "four chunks where each keeps 16K elements."
        ),
    ] = DEFAULT_CHUNK,
    layout: Annotated[
        str, typer.Option(help="archive: smallest. serving: 2-D BF16 weights as fixed-rate tiles for GPU kernels.")
    ] = "archive",
    max_memory: MaxMemory = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Compress a Hugging Face checkpoint into a folder that mirrors it.

    Every *.safetensors file becomes an Unweight container of the same name; the shard index,
    config and tokenizer files are kept. Nothing appears at DST unless the whole run succeeds:
    an interrupted run (Ctrl-C, SIGTERM, SIGHUP) removes its hidden .DST.partial-PID folder, and a
    killed run's is removed by the next run to DST. Symbolic links must resolve inside SRC (linked
    files are copied as their contents); links that leave it, FIFOs and devices are refused.

    Examples:

        unweight compress ./Llama-3.1-8B ./llama-uw

        unweight compress meta-llama/Llama-3.1-8B ./llama-uw --revision main --json

        unweight compress ./Llama-3.1-8B ./llama-serving --layout serving
    """

    def body() -> None:
        with _progress("compressing", quiet or as_json) as bar:
            report = unweight.compress(
                src,
                dst,
                threads=threads,
                verify=verify,
                precision=precision,
                chunk=chunk,
                layout=layout,
                revision=revision,
                progress=bar,
                max_memory=max_memory,
            )
        if as_json:
            _print_json(report.to_json())
            return
        from .render import compress_table

        out.print(compress_table(report))
        for note in report.notes():
            err.print(f"note: {safe(note)}", highlight=False, soft_wrap=True)
        for f in report.skipped_files:
            err.print(
                f"note: skipped {safe(f)} (pickle; the safetensors files carry the weights)",
                highlight=False,
                soft_wrap=True,
            )

    _run(body, writes=True, kernels=True)


@app.command()
def decompress(
    src: Annotated[Path, typer.Argument(help="Compressed folder or container file.")],
    dst: Annotated[Path, typer.Argument(help="Output folder (must not exist).")],
    threads: Threads = None,
    max_memory: MaxMemory = None,
    quiet: Quiet = False,
) -> None:
    """Write the original safetensors files back, byte for byte (large tensors in pieces).

    Example:

        unweight decompress ./llama-uw ./llama-bf16
    """

    def body() -> None:
        with _progress("decompressing", quiet) as bar:
            n = unweight.decompress(src, dst, threads=threads, progress=bar, max_memory=max_memory)
        out.print(f"wrote {n} tensors to {safe(dst)}", highlight=False, soft_wrap=True)

    _run(body, writes=True, kernels=True)


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="Compressed folder or container file.")],
    against: Annotated[
        Path | None, typer.Option("--against", help="The original folder or file to compare with.")
    ] = None,
    threads: Threads = None,
    max_memory: MaxMemory = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Decode every tensor and check it; exit 0 only if everything matches.

    Each tensor's decoded bytes are checked against their stored CRC-32, and its stored streams
    against theirs (format 1.1); with --against, against the original bytes, dtypes and shapes.
    A sharded folder is checked against its index: a missing shard or tensor fails. A folder is
    checked to be one model: every container one that compress wrote with the others (its
    member list, unweight-folder.json), none of another model or revision. The first difference is
    reported. Run it after every download.

    Examples:

        unweight verify ./llama-uw

        unweight verify ./llama-uw --against ./Llama-3.1-8B
    """

    def body() -> int:
        with _progress("verifying", quiet or as_json) as bar:
            report = unweight.verify(path, against, threads=threads, progress=bar, max_memory=max_memory)
        if as_json:
            _print_json(report.to_json())
        elif report.ok:
            what = "identical to the original" if against else "checksums OK"
            out.print(
                f"OK: {report.checked_tensors} tensors ({report.checked_bytes / 1e6:,.1f} MB) in "
                f"{report.checked_files} files, {what}"
            )
            if not report.vouched and path.is_dir() and not against:
                err.print(
                    f"note: this folder has no {MEMBERS_NAME} (compressed by an older unweight): verify cannot "
                    "vouch that its files come from one compress of one model; --against the original can",
                    highlight=False,
                )
        else:
            err.print(f"[bold red]MISMATCH:[/] {safe(report.mismatches[0])}", highlight=False, soft_wrap=True)
            if len(report.mismatches) > 1:
                err.print(f"... and {len(report.mismatches) - 1} more")
            if report.missing:
                err.print(
                    f"{len(report.missing)} tensors that the shard index lists were not found "
                    f"(--json lists them); the other {report.checked_tensors} were checked",
                    highlight=False,
                )
        return 0 if report.ok else EXIT_FAILED

    _run(body, kernels=True)


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="Compressed folder or container file.")],
    as_json: AsJson = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write exponent histograms to this PNG (needs matplotlib).")
    ] = None,
    tensors: Annotated[
        bool, typer.Option("--tensors", help="One row per tensor instead of one per layer type.")
    ] = False,
    threads: Threads = None,
    max_memory: MaxMemory = None,
) -> None:
    """Codecs, sizes, bits/weight, exponent entropy and the gap to the order-0 bound.

    The table has one row per layer type (every layer's q_proj, every expert's down_proj: layer
    and expert numbers read as *) and a total per class; --tensors gives one row per tensor.
    --json prints every tensor's statistics.

    Example:

        unweight inspect ./llama-uw --plot exponents.png
    """

    def body() -> None:
        from unweight.codec.parallel import default_threads

        # as many worker processes as threads (for a checkpoint of many tensors: unweight.inspect)
        stats = unweight.inspect(path, threads=threads, max_memory=max_memory, processes=threads or default_threads())
        if plot is not None:
            from .plotting import plot_exponents

            plot_exponents(stats, plot)
        if as_json:
            _print_json([s.to_json() for s in stats])
            return
        from .render import inspect_groups_table, inspect_lines

        if tensors:
            sys.stdout.writelines(line + "\n" for line in inspect_lines(stats))
            sys.stdout.flush()
        else:
            from unweight.inspection import group

            out.print(inspect_groups_table(group(stats), len({s.file for s in stats})))
        if plot is not None:
            out.print(f"wrote {safe(plot)}", highlight=False, soft_wrap=True)

    _run(body)


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="A model folder, or a Hub id (only its config.json is fetched).")],
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu",
            help="h100 (79.11 GiB, what CUDA reports of an H100 80 GB), h200 (139.80 GiB), or a GPU's memory in "
            "GiB (e.g. 96).",
        ),
    ] = "h100",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel size.")] = 1,
    dp: Annotated[
        int, typer.Option("--dp", help="Data-parallel size (vLLM's --data-parallel-size): attention per rank.")
    ] = 1,
    expert_parallel: Annotated[
        bool,
        typer.Option("--enable-expert-parallel", help="Whole experts per GPU, as vLLM's flag of that name."),
    ] = False,
    kv_cache_dtype: Annotated[
        str, typer.Option("--kv-cache-dtype", help="The KV cache's dtype, as vLLM names it: auto (BF16) or fp8.")
    ] = "auto",
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", help="The share of each GPU vLLM may take.")
    ] = 0.9,
    as_json: AsJson = False,
) -> None:
    """What each GPU holds of a model and the KV cache that fits beside it, from its config.json alone.

    BF16 against unweight's resident layout; no weights are read. Weights are counted by tensor class
    as vLLM builds the layers (INT4 experts of a compressed-tensors checkpoint as 4-bit codes and
    BF16 scales); unweight's resident layout is estimated at 0.71 of the BF16 bytes it compresses,
    and INT4 experts as a GPU's W4A16 GEMV holds them (codes as stored, scales at a measured 0.591
    of their bytes); vLLM's activation reserve is estimated too. With --dp, each data-parallel rank
    holds its own attention and KV cache and the experts spread over every GPU. KV tokens are counted at
    the model's own KV layout (MLA's latent cache for DeepSeek-V3 and Kimi). A config.json with a field
    missing, mistyped or out of bounds, and sizes that vLLM would refuse (a --tp that does not divide
    the attention heads, the kv heads or the dense MLP; experts that do not split over tp x dp GPUs),
    are refused with one line naming the field.

    Examples:

        unweight plan meta-llama/Llama-4-Scout-17B-16E-Instruct --gpu h200 --tp 2

        unweight plan ./Kimi-K2.5 --gpu h100 --tp 8 --json

        unweight plan ./Kimi-K2.5 --gpu h200 --dp 8 --enable-expert-parallel
    """

    def body() -> None:
        from unweight import plan as planning

        gpu_bytes = planning.GPUS.get(gpu.lower())
        if gpu_bytes is None:
            try:
                gib = float(gpu)
            except ValueError:
                gib = float("nan")
            if not 0 < gib <= 1 << 20:  # (NaN and infinity fail too)
                raise ValueError(f"--gpu {gpu!r}: not h100, h200 or a number of GiB (above 0, up to 1048576)")
            gpu_bytes = max(1, int(gib * (1 << 30)))
        kv_bytes = {"auto": 2, "bfloat16": 2, "fp8": 1}.get(kv_cache_dtype)
        if kv_bytes is None:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: not auto, bfloat16 or fp8")
        folder = Path(model)
        if not folder.is_dir():
            if folder.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
                raise ValueError(f"{model}: no such model folder (or Hub id: ORG/NAME)")
            from unweight.hub import resolve_source

            folder = Path(resolve_source(model, patterns=["config.json"]))
        config = planning.read_config(folder)
        result = planning.plan(
            config,
            gpu_bytes,
            tp,
            pp,
            dp=dp,
            expert_parallel=expert_parallel,
            kv_dtype_bytes=kv_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if as_json:
            _print_json(result.to_json())
            return
        from .render import plan_tables

        for table in plan_tables(result, model, gpu_memory_utilization):
            out.print(table)
        for note in result.notes:
            out.print(f"note: {note}", highlight=False)

    _run(body)


@app.command()
def generate(
    model: Annotated[Path, typer.Argument(help="Compressed model folder (made by `unweight compress`).")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text.")],
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt as a user message in the model's chat template.")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy; higher is more random.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k best tokens (0 = all).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop before this string (repeatable).")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda[:n].")] = "cpu",
    layout: Annotated[
        str, typer.Option(help="serving: fused kernels over tiles; archive: smallest, decoded at each use.")
    ] = "serving",
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="Compute dtype, as vLLM's --dtype: auto (bfloat16 on a GPU and on a CPU with AVX512_BF16, float32 "
            "on other CPUs), bfloat16 or float32.",
        ),
    ] = "auto",
    threads: Threads = None,
) -> None:
    """Generate text from a compressed model, streamed to the terminal.

    Then one line of stats (on stderr): prompt tokens, generated tokens, time to first token,
    tokens/s, resident weights beside the checkpoint's uncompressed size.

    Examples:

        unweight generate ./smollm2-uw --chat --prompt "What is the capital of France?"

        unweight generate ./llama-uw -p "Once upon a time" -n 64 --temperature 0.8 --seed 1
    """

    def body() -> None:
        from unweight.runtime.model.sampling import SamplingParams

        sampling = SamplingParams(
            max_new_tokens, temperature, top_p, top_k, seed, stop or []
        )  # bad values fail before the load
        tok = unweight.load_tokenizer(model)
        m = unweight.load(model, device=device, layout=layout, threads=threads, dtype=dtype)
        g = unweight.stream(m, tok, prompt, chat=chat, **{k: getattr(sampling, k) for k in SamplingParams.__slots__})
        for piece in g:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()  # before the stats on stderr, also when both go to one pipe
        from .render import generation_stats

        # the load report brings the checkpoint's uncompressed size: no second read of its headers
        stats = generation_stats(g.result, m.resident_weight_bytes(), m.load_report)
        err.print(stats, highlight=False, soft_wrap=True)

    _run(body, kernels=True)


# `serve`'s longer options, named here so that its signature reads one flag to a line
ServeApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="UNWEIGHT_API_KEY",
        help="Require `Authorization: Bearer KEY` on every endpoint, /health and /metrics included.",
    ),
]
ServeEngineApiKey = Annotated[
    str | None,
    typer.Option(
        "--engine-api-key",
        envvar="UNWEIGHT_ENGINE_API_KEY",
        help="With --engine vllm: the key the engines were started with (`vllm serve --api-key`), sent to each.",
    ),
]
ServeMaxBody = Annotated[
    int,
    typer.Option(
        "--max-body-bytes", min=1024, help="Largest request body; larger ones get HTTP 413 before they are read."
    ),
]
ServeKeepAlive = Annotated[
    float,
    typer.Option(
        "--timeout-keep-alive", min=0.001, help="Seconds an idle connection (before or between requests) stays open."
    ),
]
ServeHeaderTimeout = Annotated[
    float,
    typer.Option(
        "--timeout-header",
        min=0.001,
        help="Seconds a client has to send a request's head, from connecting or from the previous response.",
    ),
]
ServeBodyTimeout = Annotated[
    float,
    typer.Option(
        "--timeout-body",
        min=0.001,
        help="Seconds a client has to send a request's body, from the end of its head (then HTTP 408).",
    ),
]
ServeWorkerThreads = Annotated[
    int,
    typer.Option(
        "--worker-threads",
        min=0,
        help="CPU threads per worker (0: this machine's cores split among the local workers).",
    ),
]
ServeKVTokens = Annotated[
    int | None,
    typer.Option(
        "--kv-cache-tokens",
        help="KV cache pool of each decode (or --no-disagg) worker, in tokens (default: --max-batch sequences of "
        "the full context). The context served is at most this; when the pool is full, new sequences wait and the "
        "newest running one is swapped out.",
    ),
]
ServeDtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="Compute dtype, as vLLM's --dtype: auto (bfloat16 on a GPU and on a CPU with AVX512_BF16, float32 "
        "on other CPUs), bfloat16 or float32. "
        "The weights are exact in either; bfloat16 rounds activations (docs/runtime.md).",
    ),
]
ServeKVDtype = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        help="The KV cache's dtype: auto (the compute dtype), bfloat16 or float32. bfloat16 "
        "halves the cache and the hand-off; the text may then differ from float32's (docs/serving.md).",
    ),
]
ServeKVCompression = Annotated[
    str,
    typer.Option(
        "--kv-compression",
        help="Code the KV hand-off losslessly: auto (off loopback, when the link, measured, is slower than the "
        "codec), on, off.",
    ),
]
ServeKVEncryption = Annotated[
    str,
    typer.Option(
        "--kv-encryption",
        help="Seal the KV hand-off with ChaCha20-Poly1305 under the control secret: auto (off loopback), on, off. "
        "A decode worker with it on refuses unsealed KV.",
    ),
]
ServeGenerationConfig = Annotated[
    str,
    typer.Option(
        "--generation-config",
        help="Defaults for what a request leaves out of temperature, top_p, top_k, min_p and repetition_penalty: "
        "auto (the model's generation_config.json, as vLLM takes it), vllm (OpenAI's: temperature 1, none of the "
        "others).",
    ),
]
ServeSecretFile = Annotated[
    Path | None,
    typer.Option(
        "--control-secret-file",
        help="File (mode 600, one line of >= 32 characters) holding the secret that authenticates router and "
        "workers to each other. Needed by --role router and by workers started by hand; without it the router "
        "makes one for the workers it starts.",
    ),
]
ServeWorkerTimeout = Annotated[
    float,
    typer.Option(
        "--worker-timeout",
        envvar="UNWEIGHT_WORKER_TIMEOUT",
        help="Seconds without a heartbeat after which a worker counts as hung and its requests fail (503).",
    ),
]


ServeEngine = Annotated[
    str,
    typer.Option(
        "--engine",
        help="unweight: this project's workers serve MODEL. vllm (with --role router): a router in front of "
        "`vllm serve` engines that hand the KV over with UnweightConnector (--prefill-url, --decode-url).",
    ),
]
ServePrefillURL = Annotated[
    list[str] | None,
    typer.Option(
        "--prefill-url",
        help="With --engine vllm: a prefill engine (kv_producer), http://HOST:PORT; repeatable (the one with the "
        "fewest requests in flight takes each).",
    ),
]
ServeDecodeURL = Annotated[
    list[str] | None,
    typer.Option(
        "--decode-url",
        help="With --engine vllm: a decode engine (kv_consumer), http://HOST:PORT; repeatable.",
    ),
]


@app.command()
def serve(
    model: Annotated[
        Path | None,
        typer.Argument(help="Compressed model folder (made by `unweight compress`); none with --engine vllm."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (HTTP and control).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8000,
    prefill_workers: Annotated[int, typer.Option("--prefill-workers", help="Prefill worker processes to start.")] = 1,
    decode_workers: Annotated[int, typer.Option("--decode-workers", help="Decode worker processes to start.")] = 1,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Most sequences in one decode batch.")] = 16,
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", help="Longest prompt + completion (default: the model's).")
    ] = None,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests in flight beyond which new ones get HTTP 429.")
    ] = 64,
    device: Annotated[str, typer.Option(help="cpu or cuda[:n] for the workers.")] = "cpu",
    api_key: ServeApiKey = None,
    public_health: Annotated[
        bool, typer.Option("--public-health", help="Let /health and /metrics answer without the API key.")
    ] = False,
    max_body_bytes: ServeMaxBody = 16 << 20,
    timeout_keep_alive: ServeKeepAlive = 5.0,
    timeout_header: ServeHeaderTimeout = 10.0,
    timeout_body: ServeBodyTimeout = 30.0,
    limit_concurrency: Annotated[
        int, typer.Option("--limit-concurrency", min=1, help="Open connections beyond which requests get HTTP 503.")
    ] = 512,
    no_disagg: Annotated[
        bool, typer.Option("--no-disagg", help="One aggregated worker that prefills and decodes (for comparison).")
    ] = False,
    role: Annotated[
        str, typer.Option(help="all (default: router plus local workers), router, prefill, decode or worker.")
    ] = "all",
    name: Annotated[
        str | None, typer.Option(help="Worker name (with --role prefill|decode|worker), unique per router.")
    ] = None,
    router_address: Annotated[
        str | None, typer.Option("--router-address", help="HOST:PORT of the router's control socket (worker roles).")
    ] = None,
    control_port: Annotated[int, typer.Option("--control-port", help="Router control port (0: any free port).")] = 0,
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="Model id clients use (default: the folder name).")
    ] = None,
    worker_threads: ServeWorkerThreads = 0,
    kv_cache_tokens: ServeKVTokens = None,
    dtype: ServeDtype = "auto",
    kv_cache_dtype: ServeKVDtype = "auto",
    kv_compression: ServeKVCompression = "auto",
    kv_encryption: ServeKVEncryption = "auto",
    generation_config: ServeGenerationConfig = "auto",
    control_secret_file: ServeSecretFile = None,
    worker_timeout: ServeWorkerTimeout = 10.0,
    engine: ServeEngine = "unweight",
    prefill_url: ServePrefillURL = None,
    decode_url: ServeDecodeURL = None,
    engine_api_key: ServeEngineApiKey = None,
) -> None:
    """Serve a compressed model behind an OpenAI-compatible API.

    Prefill and decode run in separate worker processes; the KV cache goes from one to the other
    over torch.distributed.

    Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true for SSE),
    GET /v1/models, GET /v1/models/ID, GET /health, GET /metrics (Prometheus, vLLM's metric names).

    Examples:

        unweight serve ./smollm2-uw --port 8000

        unweight serve ./smollm2-uw --no-disagg

        unweight serve ./llama-uw --role router --host 10.0.0.1 --control-port 5555 \\
            --control-secret-file ~/.unweight-secret

        unweight serve ./llama-uw --role decode --name decode-0 --router-address 10.0.0.1:5555 \\
            --control-secret-file ~/.unweight-secret

        unweight serve --role router --engine vllm --prefill-url http://10.0.0.2:8100 \\
            --decode-url http://10.0.0.3:8200 --served-model-name llama

    The control plane (router <-> workers) is ZeroMQ CURVE with keys derived from the control
    secret: no process without it can join as a worker, or pose as the router.

    With --engine vllm the router fronts `vllm serve` engines that hand the KV cache over with
    UnweightConnector (docs/serving.md, "In front of vLLM engines"): each request is prefilled on a
    --prefill-url engine and decoded on a --decode-url engine.
    """
    settings = dict(locals())
    for flag in ("model", "role", "engine", "prefill_url", "decode_url"):
        del settings[flag]
    if engine == "vllm":
        _run(lambda: _serve_vllm(model, role, prefill_url or [], decode_url or [], settings))
    plain = engine == "unweight" and model is not None and not prefill_url and not decode_url
    for flag in ("name", "router_address", "no_disagg", "engine_api_key"):
        del settings[flag]

    def body() -> None:
        from unweight.runtime.serve.launch import launch

        if engine != "unweight":
            raise ValueError(f"--engine {engine!r} is not one of unweight, vllm")
        if model is None:
            raise ValueError("serve needs MODEL, a compressed model folder (none only with --engine vllm)")
        if prefill_url or decode_url or engine_api_key:
            raise ValueError("--prefill-url, --decode-url and --engine-api-key are for the engines of --engine vllm")

        secret_file = str(control_secret_file) if control_secret_file else None
        launch(
            model,
            role=role,
            name=name,
            router_address=router_address,
            **{**settings, "disaggregated": not no_disagg, "control_secret_file": secret_file},
        )

    _run(body, kernels=plain)


# serve's settings that the router in front of vLLM engines takes (the others are its own workers')
VLLM_ROUTER_SETTINGS = (
    "host",
    "port",
    "api_key",
    "engine_api_key",
    "public_health",
    "max_queue",
    "max_body_bytes",
    "timeout_keep_alive",
    "timeout_header",
    "timeout_body",
    "limit_concurrency",
    "served_model_name",
)


def _serve_vllm(model: Path | None, role: str, prefill_urls: list[str], decode_urls: list[str], settings: dict) -> None:
    """`serve --engine vllm`: the router alone, in front of `vllm serve` engines."""
    import inspect

    if role != "router":
        raise ValueError("--engine vllm runs the router alone: add --role router (the engines are `vllm serve`)")
    if model is not None:
        raise ValueError(
            f"{model}: --engine vllm takes no MODEL (the engines load it; clients ask for --served-model-name)"
        )
    defaults = inspect.signature(serve).parameters
    for flag, value in settings.items():
        # (--worker-timeout may come from UNWEIGHT_WORKER_TIMEOUT, set for other servers)
        if flag not in VLLM_ROUTER_SETTINGS and flag != "worker_timeout" and value != defaults[flag].default:
            raise ValueError(f"--{flag.replace('_', '-')} is a setting of unweight's workers: not with --engine vllm")
    from unweight.runtime.serve.vllm_router import VLLMRouterConfig
    from unweight.runtime.serve.vllm_router import serve as serve_vllm

    cfg = VLLMRouterConfig(
        prefill_urls=prefill_urls, decode_urls=decode_urls, **{k: settings[k] for k in VLLM_ROUTER_SETTINGS}
    )
    serve_vllm(cfg)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except BrokenPipeError:  # `unweight inspect ... | head`
        sys.stderr.close()


if __name__ == "__main__":
    main()
