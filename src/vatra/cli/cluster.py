"""``vatra cluster up | run | down``: a multi-host test cluster of network namespaces on this machine."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra.cli.app import app
from vatra.launch.cluster import Cluster, ClusterSpec

cluster_app = typer.Typer(
    rich_markup_mode=None,
    help="A real multi-host cluster on one machine (network namespaces, shaped links; needs root).",
    no_args_is_help=True,
)
app.add_typer(cluster_app, name="cluster")

NAME = typer.Option("vatra", "--name", help="Cluster name (prefix of its namespaces).")


@cluster_app.command("up")
def cluster_up(
    hosts: int = typer.Option(2, "--hosts", help="Number of hosts (network namespaces)."),
    bandwidth: str = typer.Option("100mbit", "--bandwidth", help="Each host's link rate, both ways."),
    procs_per_host: int = typer.Option(1, "--procs-per-host", help="Worker processes per host for run."),
    latency_ms: float = typer.Option(
        0.0, "--latency-ms", help="One-way host-to-host latency (netem; refused where the kernel lacks it)."
    ),
    name: str = NAME,
) -> None:
    """Create the hosts, the switch and shaped links."""
    spec = ClusterSpec(
        name=name, hosts=hosts, bandwidth=bandwidth, procs_per_host=procs_per_host, latency_ms=latency_ms
    )
    cluster = Cluster.up(spec)
    addrs = ", ".join(f"{h.netns}={h.address}" for h in cluster.hosts)
    delay = f", {latency_ms:g} ms one way" if latency_ms else ""
    print(f"cluster {name!r} up: {hosts} hosts × {procs_per_host} procs at {bandwidth}{delay} ({addrs})")


@cluster_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def cluster_run(
    ctx: typer.Context,
    name: str = NAME,
    timeout: float | None = typer.Option(None, "--timeout", help="Stop every host after this many seconds."),
    private_dir: list[Path] = typer.Option(
        [],
        "--private-dir",
        help="Give each host its own copy of this folder (host I sees FOLDER.hI there): no shared "
        "run folder, as between machines (repeatable).",
    ),
) -> None:
    """Run a command on every host: vatra cluster run -- vatra train CONFIG [--set k=v]."""
    cluster = Cluster.load(name)
    code = cluster.run(list(ctx.args), timeout=timeout, private=private_dir)
    if code:
        # not typer.Exit: under standalone_mode=False click returns its code instead of exiting
        raise SystemExit(code)


@cluster_app.command("down")
def cluster_down(name: str = NAME) -> None:
    """Stop what runs in the cluster and remove its namespaces, links and bridge."""
    removed = Cluster.down(name)
    print(f"cluster {name!r} down: removed {len(removed)} namespaces" if removed else f"no cluster {name!r}")
