"""Launching workers: local processes and multi-node jobs through the elastic agent."""

from vatra.launch.local import LaunchSpec, WorkerFailure, free_port, launch_workers, parse_nnodes

__all__ = ["LaunchSpec", "WorkerFailure", "free_port", "launch_workers", "parse_nnodes"]
