"""``vatra federate`` (simulation) and ``vatra fl certs|server|client`` (deployment over gRPC)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from vatra.cli.app import app
from vatra.config import dump_toml, load_config
from vatra.errors import ConfigError
from vatra.rundir import RunDir, new_run_id

SET_HELP = "Override a config value: section.key=value (repeatable)."

fl_app = typer.Typer(
    rich_markup_mode=None, help="Federated deployment over gRPC with TLS.", no_args_is_help=True
)
app.add_typer(fl_app, name="fl")


def _run_dir(cfg_out: str, name: str, given: Path | None) -> RunDir:
    return RunDir(given or Path(cfg_out) / new_run_id(name)).create()


@app.command()
def federate(
    config: Path = typer.Argument(
        ..., help="TOML config with a [federated] section, e.g. examples/fl_digits.toml."
    ),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run folder (default runs/<name>-<time>)."),
) -> None:
    """Simulate federated training of N clients on this machine (a process pool, deterministic for a seed)."""
    from vatra.federated.simulation import simulate  # torch import only when the command runs

    cfg = load_config(config, set_, run="federated")
    rd = _run_dir(cfg.run.out_dir, cfg.run.name, run_dir)
    with rd.lock("vatra federate"):
        print(f"vatra: run folder {rd.path}", flush=True)
        simulate(cfg, rd, progress=cfg.run.progress != "off")


@fl_app.command("certs")
def certs(
    folder: Path = typer.Argument(..., help="Folder to write the CA, server certificate and tokens into."),
    clients: int = typer.Option(..., "--clients", help="Number of client tokens (ids 0 .. N-1)."),
    host: list[str] = typer.Option(
        [], "--host", help="The server's DNS name or IP as remote clients reach it (repeatable)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace a CA already in FOLDER (old tokens stop working)."
    ),
) -> None:
    """Generate a CA, a TLS server certificate (localhost, 127.0.0.1 + --host) and one token per client."""
    from vatra.federated.certs import generate

    if clients < 1:
        raise ConfigError(f"--clients {clients}: must be ≥ 1")
    generate(folder, clients, host, force=force)
    print(f"vatra: wrote CA, server certificate and {clients} client token(s) to {folder}", flush=True)
    print(
        f"vatra: warning: {folder / 'ca.key'} is a secret: whoever holds it can admit any client; keep it "
        f"(and server.key, clients/) off shared drives and out of git ({folder / '.gitignore'} ignores the "
        "folder); give client i only ca.pem and clients/<i>.token",
        file=sys.stderr,
        flush=True,
    )


@fl_app.command("server")
def server(
    config: Path = typer.Argument(..., help="TOML config with a [federated] section."),
    address: str = typer.Option(..., "--address", help="HOST:PORT to listen on, e.g. 0.0.0.0:7070."),
    certs: Path = typer.Option(..., "--certs", help="Folder made by 'vatra fl certs'."),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run folder; an existing one with a checkpoint is resumed."
    ),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    eval_data: str | None = typer.Option(
        None,
        "--eval-data",
        help="The server's own held-out data (a CSV/Parquet/npz file, an image folder or an import "
        "string), read with the config's data options; every round scores the global model on it.",
    ),
) -> None:
    """Run the federated server: select clients, collect updates, aggregate, checkpoint every round."""
    from vatra.federated.certs import ServerCredentials
    from vatra.federated.grpc import serve

    cfg = load_config(config, set_, run="federated")
    if ":" not in address:
        raise ConfigError(f"--address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:7070")
    ServerCredentials(certs)  # a missing or incomplete folder fails before a run folder is made
    rd = _run_dir(cfg.run.out_dir, cfg.run.name, run_dir)
    with rd.lock("vatra fl server"):
        if not rd.config.exists():
            rd.config.write_text(dump_toml(cfg))
        serve(cfg, address, certs, rd, eval_data=eval_data, progress=cfg.run.progress != "off")


@fl_app.command("client")
def client(
    server_addr: str = typer.Option(..., "--server", help="HOST:PORT of the federated server."),
    client_id: int = typer.Option(..., "--client-id", help="This client's id (0 .. federated.clients-1)."),
    config: Path = typer.Option(..., "--config", help="The same TOML config the server runs."),
    certs: Path = typer.Option(..., "--certs", help="Folder with ca.pem and clients/<id>.token."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    retry_s: float = typer.Option(
        60.0, "--retry-s", help="Keep reconnecting this long if the server is down."
    ),
    slow_s: float = typer.Option(0.0, "--slow-s", help="Sleep before each upload (emulates a slow device)."),
    device_profile: str | None = typer.Option(
        None,
        "--device-profile",
        help="The device this client runs on: laptop, phone, raspberry or one of federated.edge."
        "device_profiles; the server sends the int8 model when the fp32 one is over its max_model_mb.",
    ),
    data: str | None = typer.Option(
        None,
        "--data",
        help="This owner's data: a CSV/Parquet/npz file, an image folder or an import string "
        "'pkg.mod:fn', read with the config's data options (target, features, split); "
        "default: the config's data section. It holds out its own validation split.",
    ),
) -> None:
    """Join a federated server and train on this client's own data until the server is done."""
    from vatra.federated.grpc import run_client

    cfg = load_config(config, set_, run="federated")
    run_client(
        cfg,
        server_addr,
        client_id,
        certs,
        data=data,
        retry_s=retry_s,
        slow_s=slow_s,
        progress=cfg.run.progress != "off",
        device_profile=device_profile,
    )
