"""Deployment over gRPC with TLS: the hub and ``serve`` (server), ``run_client`` and ``RemoteServer``
(client), and the guard that bounds what a peer can make the server do before any handler runs."""

from __future__ import annotations

from vatra.federated.grpc.client import client_data, run_client
from vatra.federated.grpc.hub import Hub
from vatra.federated.grpc.remote import RemoteServer
from vatra.federated.grpc.server import message_sizes, serve

__all__ = ["Hub", "RemoteServer", "client_data", "message_sizes", "run_client", "serve"]
