"""The flags a cluster's commands share (`laneway up`, `laneway bench`, `laneway whatif`): which
servers, how prefill is split off, which step-time model. Apart from `infra.bench`, so that the
CLI's start loads no benchmark."""

from __future__ import annotations

import argparse
from pathlib import Path

from infra.arg_types import renamed
from services.common.perf_model import PERF_MODEL_NAMES


def add_disagg_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--disagg",
        choices=["never", "always", "auto"],
        default="auto",
        help="with prefill workers: prefill remotely never, always, or when it pays (kv policy)",
    )


def add_server_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The NATS and etcd a cluster uses where the operator runs them (``what``: the command's
    words for the embedded ones), and who the services are there."""
    parser.add_argument("--nats-url", help=f"use this NATS instead of {what}")
    parser.add_argument("--etcd-endpoints", help=f"use this etcd (host:port) instead of {what}")
    parser.add_argument(
        "--bus-credentials",
        type=Path,
        metavar="DIR",
        help="with --nats-url and --etcd-endpoints: the folder of `laneway bus provision`; each "
        "service runs as a user of its own there (by default all use the credentials given)",
    )


def add_perf_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--perf-model",
        choices=PERF_MODEL_NAMES,
        default="dynamo-mocker",
        help="step times of the sim engine and of the kv policy's predictions where a worker "
        "reports none of its own (a real engine measures its own): Dynamo mocker's model, or "
        "cheap and linear",
    )
    # Its names before 2026-12-01 (`laneway up --timing`, `laneway bench --engine-preset`).
    parser.add_argument(
        "--timing",
        "--engine-preset",
        dest="perf_model",
        choices=PERF_MODEL_NAMES,
        default=argparse.SUPPRESS,
        action=renamed("--perf-model"),
        help=argparse.SUPPRESS,
    )
