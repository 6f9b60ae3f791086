"""Secure aggregation (Bonawitz et al. CCS'17; SecAgg+, Bell et al. CCS'20): the server learns the sum."""

from __future__ import annotations

from vatra.federated.secagg.channel import Channel, ClientParty, LocalParties, RemoteParties, secure_sum
from vatra.federated.secagg.combiner import SecAggCombiner, SecAggExecutor
from vatra.federated.secagg.crypto import SecAggError
from vatra.federated.secagg.protocol import STAGES, Quantizer, RoundAborted, SecAggClient
from vatra.federated.secagg.server import SecAggServer

__all__ = [
    "STAGES",
    "Channel",
    "ClientParty",
    "LocalParties",
    "Quantizer",
    "RemoteParties",
    "RoundAborted",
    "SecAggClient",
    "SecAggCombiner",
    "SecAggError",
    "SecAggExecutor",
    "SecAggServer",
    "secure_sum",
]
