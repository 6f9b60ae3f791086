"""``vatra model serve``: a registered model over HTTP, with an A/B split and hot swap."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra.cli.model import KEY_ENV, REGISTRY, model_app, open_registry


@model_app.command("serve")
def model_serve(
    name: str = typer.Argument(
        ..., help="Model name in the registry, or NAME@ALIAS (default: its champion alias, else its newest)."
    ),
    ab: str = typer.Option(
        "", "--ab", help="A/B split by alias, e.g. champion=0.9,challenger=0.1 (sticky per request key)."
    ),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: a free one, printed)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    registry: str | None = REGISTRY,
    hmac_key_env: str | None = KEY_ENV,
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where predictions.jsonl and outcomes.jsonl go (default: runs/serve/NAME)."
    ),
    max_batch: int = typer.Option(64, "--max-batch", help="Most rows scored in one model call."),
    max_wait_ms: float = typer.Option(
        5.0, "--max-wait-ms", help="Latency budget: the longest a request waits to share a model call."
    ),
    max_body_mb: float = typer.Option(16.0, "--max-body-mb", help="Larger request bodies are refused (413)."),
    poll_s: float = typer.Option(1.0, "--poll-s", help="How often each alias is checked for a new version."),
    threads: int = typer.Option(
        0, "--threads", help="PyTorch threads per model call (0: PyTorch's default; 1 suits small models)."
    ),
) -> None:
    """Serve a registered model: POST /predict (JSON rows or Arrow), POST /outcome, GET /metrics
    (Prometheus) and GET /healthz. Concurrent requests share model calls; when an alias moves, the
    new version is loaded in the background and swapped in between batches."""
    from vatra._extras import check
    from vatra.errors import ConfigError
    from vatra.serve.app import ServeConfig, create_app, load_slots
    from vatra.serve.server import bind, run, url
    from vatra.serve.sources import RegistrySource
    from vatra.serve.split import Split

    for module in ("fastapi", "uvicorn"):  # before a model is fetched and loaded
        check(module, "serve", "vatra model serve")
    if threads < 0:
        raise ConfigError(f"--threads must be 0 (PyTorch's default) or more, not {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    model, _, ref = name.partition("@")
    if ab and ref:
        raise ConfigError(f"give NAME@ALIAS or --ab, not both ({name!r} with --ab {ab!r})")
    source = RegistrySource(open_registry(registry, hmac_key_env), model)
    split = Split.parse(ab) if ab else Split.single(ref or source.default_ref())
    cfg = ServeConfig(
        split=split,
        log_dir=log_dir or Path("runs") / "serve" / model,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        max_body_bytes=int(max_body_mb * (1 << 20)),
        poll_s=poll_s,
    )
    slots = load_slots(source, split)
    sock = bind(host, port)
    served = ", ".join(
        f"{alias}={slots[alias].version[:12]} ({w:.0%})"
        for alias, w in zip(split.aliases, split.weights, strict=True)
    )
    print(f"vatra: serving {model} on {url(sock)}: {served}; logs in {cfg.log_dir}", flush=True)
    run(create_app(source, cfg, slots), sock)
