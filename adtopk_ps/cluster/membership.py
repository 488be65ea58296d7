"""Cluster membership: who a node is, how many peers it has, and which server owns a key.

This is ps-lite's Postoffice: everything here is derived from the DMLC/BytePS
environment contract, so a node can be configured the same way on one host,
by hand on several machines, or in Kubernetes pods. A tensor's key layout (its
partitions, their keys and the servers that own them) is byteps'.

Registration and the address book (which node is which rank, and where every server
listens) are the scheduler's, in scheduler.py; a node's side of that exchange
(``SchedulerLink``: register, heartbeats, barriers) is in transport.py.
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    import torch

from adtopk_ps.cluster.stop import stop_quietly_on_signals
from adtopk_ps.core.env import EnvError, env_int

ROLES = ("scheduler", "server", "worker")
DEFAULT_PARTITION_BYTES = 4096000
PARTITION_BITS = 16
#: PS_PLACEMENT's values: keys spread by the bytes they move (placement.py), or byteps' hash
PLACEMENTS = ("balanced", "hash")
LOG_LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)  # by PS_VERBOSE: 0, 1, 2 (or more)


@dataclass(frozen=True)
class ClusterConfig:
    """Who this node is and what cluster it joins, read once from the DMLC/BytePS environment."""

    role: str
    num_workers: int
    num_servers: int
    root_uri: str
    root_port: int
    worker_id: int | None
    node_host: str
    heartbeat_interval: float
    heartbeat_timeout: float
    partition_bytes: int
    verbose: int | None  # PS_VERBOSE; None where unset
    # PS_MIN_WORKERS / PS_MAX_WORKERS (either makes the job elastic): it re-forms without a
    # lost worker while at least min_workers remain (below, it waits for one to join), and
    # takes in workers that join while fewer than max_workers run
    min_workers: int | None = None
    max_workers: int | None = None
    elastic_timeout: float = 600.0  # PS_ELASTIC_TIMEOUT_S: how long it waits below the minimum
    # PS_PLACEMENT: "balanced" (agreed tensors cut and spread by bytes) or "hash" (byteps')
    placement: str = "balanced"
    # PS_LISTEN_HOST: the interface a binding socket (the scheduler's, a server's) listens on:
    # every one ("*") unless set (bpslaunch --local sets 127.0.0.1: nothing off the host
    # reaches a local cluster)
    listen_host: str = "*"
    # what every worker of the job must share, as (name, value shown) pairs (``init(job=...)``):
    # a worker that joins a running elastic job with another is refused at registration
    job: tuple[tuple[str, str], ...] = ()

    @property
    def elastic(self) -> bool:
        """Whether the workers may change while the job runs (``PS_MIN_WORKERS`` or
        ``PS_MAX_WORKERS`` set)."""
        return self.min_workers is not None or self.max_workers is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) workers of an elastic job; each defaults to ``DMLC_NUM_WORKER``."""
        return (self.num_workers if self.min_workers is None else self.min_workers,
                self.num_workers if self.max_workers is None else self.max_workers)

    @property
    def scheduler_address(self) -> str:
        """The scheduler's zmq endpoint, ``tcp://DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 role: str | None = None) -> "ClusterConfig":
        """Read and check the whole DMLC contract; a missing or malformed variable raises ``EnvError`` naming it."""
        env = os.environ if environ is None else environ
        role = role or env.get("DMLC_ROLE", "")
        if role not in ROLES:
            raise EnvError(f"environment variable DMLC_ROLE={role!r} must be one of {list(ROLES)}"
                           if role else "environment variable DMLC_ROLE is required but not set")
        uri = env.get("DMLC_PS_ROOT_URI", "").strip()
        if not uri:
            raise EnvError("environment variable DMLC_PS_ROOT_URI is required but not set")
        # Every local process of a worker host is a worker of its own; hosts
        # run BYTEPS_LOCAL_SIZE of them (set it on every role when it is > 1).
        hosts = env_int("DMLC_NUM_WORKER", minimum=1, environ=env)
        local_size = env_int("BYTEPS_LOCAL_SIZE", 1, minimum=1, environ=env)
        num_workers = hosts * local_size
        worker_id = None
        if role == "worker" and env.get("DMLC_WORKER_ID", "").strip():
            host_id = env_int("DMLC_WORKER_ID", minimum=0, environ=env)
            if host_id >= hosts:
                raise EnvError(f"environment variable DMLC_WORKER_ID={host_id} must be below "
                               f"DMLC_NUM_WORKER={hosts}")
            local_rank = env_int("BYTEPS_LOCAL_RANK", 0, minimum=0, environ=env)
            if local_rank >= local_size:
                raise EnvError(f"environment variable BYTEPS_LOCAL_RANK={local_rank} must be below "
                               f"BYTEPS_LOCAL_SIZE={local_size}")
            worker_id = host_id * local_size + local_rank
        min_workers = max_workers = None
        if env.get("PS_MIN_WORKERS", "").strip():
            min_workers = env_int("PS_MIN_WORKERS", minimum=1, environ=env)
            if min_workers > num_workers:
                raise EnvError(f"environment variable PS_MIN_WORKERS={min_workers} must not be "
                               f"above the {num_workers} workers (DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE)")
        if env.get("PS_MAX_WORKERS", "").strip():
            max_workers = env_int("PS_MAX_WORKERS", minimum=1, environ=env)
            if max_workers < num_workers:
                raise EnvError(f"environment variable PS_MAX_WORKERS={max_workers} must not be "
                               f"below the {num_workers} workers (DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE)")
        placement = env.get("PS_PLACEMENT", "").strip().lower() or PLACEMENTS[0]
        if placement not in PLACEMENTS:
            raise EnvError(f"environment variable PS_PLACEMENT={env['PS_PLACEMENT']!r} must be "
                           f"one of {list(PLACEMENTS)}")
        hb_ms = env_int("PS_HEARTBEAT_INTERVAL_MS", 500, minimum=10, environ=env)
        timeout_ms = env_int("PS_HEARTBEAT_TIMEOUT_MS", 10000, minimum=2 * hb_ms, environ=env)
        listen = env.get("PS_LISTEN_HOST", "").strip() or "*"
        if listen != "*":
            try:
                ipaddress.IPv4Address(listen)
            except ValueError:
                raise EnvError(f"environment variable PS_LISTEN_HOST={listen!r} must be an IPv4 "
                               f"address of this host, or * for every interface") from None
        return cls(
            role=role,
            num_workers=num_workers,
            num_servers=env_int("DMLC_NUM_SERVER", minimum=1, environ=env),
            root_uri=uri,
            root_port=env_int("DMLC_PS_ROOT_PORT", minimum=1, environ=env),
            worker_id=worker_id,
            node_host=node_host(env),
            heartbeat_interval=hb_ms / 1000,
            heartbeat_timeout=timeout_ms / 1000,
            partition_bytes=env_int("BYTEPS_PARTITION_BYTES", DEFAULT_PARTITION_BYTES, minimum=1,
                                    environ=env),
            verbose=env_int("PS_VERBOSE", minimum=0, environ=env)
            if env.get("PS_VERBOSE", "").strip() else None,
            min_workers=min_workers,
            max_workers=max_workers,
            elastic_timeout=float(env_int("PS_ELASTIC_TIMEOUT_S", 600, minimum=1, environ=env)),
            placement=placement,
            listen_host=listen,
        )

    def apply_verbosity(self) -> None:
        """Set this process's ``adtopk_ps`` loggers to PS_VERBOSE's level, as ps-lite's nodes
        read it: 0 warnings and errors only, 1 the cluster's notices (INFO), 2 DEBUG as well.
        Unset, each role keeps its default: the scheduler and servers log INFO, a worker's
        program chooses (``python -m worker``: INFO)."""
        if self.verbose is not None:
            logging.getLogger("adtopk_ps").setLevel(LOG_LEVELS[min(self.verbose, len(LOG_LEVELS) - 1)])


def start_role(role: str) -> ClusterConfig:
    """What the scheduler's and a server's process do first: log INFO with timestamps, end
    with one line on SIGINT or SIGTERM, read the role's configuration from the environment
    (``EnvError`` names a missing or bad variable) and apply ``PS_VERBOSE``.

    Example::

        config = start_role("server")
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop_quietly_on_signals(role)
    config = ClusterConfig.from_env(role=role)
    config.apply_verbosity()
    return config


#: the most names a job's description holds, the longest name or value shown, and the most
#: characters of all of them (it travels in a registration's header)
JOB_NAMES, JOB_VALUE_CHARS, JOB_CHARS = 512, 200, 32 << 10


def describe_job(job: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """A job's description as registration carries it: its names in order, each value shown
    by ``repr``. A name or value longer than ``JOB_VALUE_CHARS`` is cut, with a digest of the
    whole, so that two that differ only past the cut still differ. More than ``JOB_NAMES``
    names, more than ``JOB_CHARS`` characters in all, or anything but a mapping with string
    names raises ``ValueError``.

    Example::

        describe_job({"optimizer.lr": 0.1, "model.name": "cnn"})
        # (('model.name', "'cnn'"), ('optimizer.lr', '0.1'))
    """
    if not isinstance(job, Mapping) or not all(isinstance(k, str) for k in job):
        raise ValueError(f"a job's description must map names (str) to values, got {type(job).__name__}")
    if len(job) > JOB_NAMES:
        raise ValueError(f"a job's description holds {len(job)} names; at most {JOB_NAMES} are allowed")
    pairs = tuple((_shown(name), _shown(repr(job[name]))) for name in sorted(job))
    chars = sum(len(a) + len(b) for a, b in pairs)
    if chars > JOB_CHARS:
        raise ValueError(f"a job's description of {chars} characters exceeds the limit of {JOB_CHARS}")
    return pairs


def _shown(text: str) -> str:
    if len(text) <= JOB_VALUE_CHARS:
        return text
    digest = hashlib.sha256(text.encode(errors="backslashreplace")).hexdigest()[:12]
    return f"{text[:JOB_VALUE_CHARS - 30]}... (sha256 {digest})"


def job_differences(ours: Sequence[Sequence[str]], theirs: Sequence[Sequence[str]]) -> list[str]:
    """Where two job descriptions differ, a line a name: ``name: the job has A, this worker B``."""
    a, b = dict(map(tuple, ours)), dict(map(tuple, theirs))
    return [f"{name}: the job has {a.get(name, '(none)')}, this worker {b.get(name, '(none)')}"
            for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


def node_host(env: Mapping[str, str]) -> str:
    """The address this node announces to its peers."""
    host = env.get("DMLC_NODE_HOST", "").strip()
    if host:
        return host
    iface = env.get("DMLC_INTERFACE", "").strip()
    if iface:
        return _interface_address(iface)
    uri = env.get("DMLC_PS_ROOT_URI", "127.0.0.1").strip()
    if uri in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return _route_address(uri)


def _interface_address(iface: str) -> str:
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", iface[:15].encode()))
        except OSError as exc:
            raise EnvError(f"environment variable DMLC_INTERFACE={iface!r}: {exc.strerror}") from None
    return socket.inet_ntoa(packed[20:24])


def _route_address(uri: str) -> str:
    """The local address the kernel would use to reach the scheduler (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((uri, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def make_key(tensor_id: int, partition: int) -> int:
    """byteps' key layout: declaration index in the high bits, partition in the low 16."""
    if not 0 <= partition < 1 << PARTITION_BITS:
        raise ValueError(f"partition {partition} does not fit in {PARTITION_BITS} bits")
    return (tensor_id << PARTITION_BITS) + partition


def name_id(name: str) -> int:
    """The tensor id of a collective, from its name alone (never from how many calls came
    before it): 40 bits of its hash, above every id given in declaration order."""
    return (1 << 40) | int.from_bytes(hashlib.blake2b(name.encode(), digest_size=5).digest(), "big")


def djb2(text: str) -> int:
    """byteps' string hash, so that a key lands on the server byteps would put it on."""
    h = 5381
    for ch in text.encode():
        h = (h * 33 + ch) & 0xFFFFFFFFFFFFFFFF
    return h


def server_of(key: int, num_servers: int) -> int:
    """byteps' default placement: djb2 of the key's decimal string, modulo S."""
    return djb2(str(key)) % num_servers


def partition_rows(shape: tuple[int, ...], element_size: int, partition_bytes: int) -> list[tuple[int, int]]:
    """Split a tensor into (start, length) blocks of at most ``partition_bytes``.

    Tensors of two or more dimensions split along dim 0, so every axis-1
    fibre stays whole in one partition and ADTopk of the parts equals ADTopk
    of the whole. Others split their flat elements.
    """
    numel = math.prod(shape)
    if numel == 0:
        return [(0, 0)]
    if len(shape) >= 2:
        unit, count = numel // shape[0], shape[0]
    else:
        unit, count = 1, numel
    per = max(1, partition_bytes // (unit * element_size))
    parts = -(-count // per)
    if parts > 1 << PARTITION_BITS:  # (before the list: a huge shape must not be laid out first)
        raise ValueError(f"a tensor of shape {shape} needs {parts} partitions of "
                         f"{partition_bytes} bytes; raise BYTEPS_PARTITION_BYTES")
    return [(start, min(per, count - start)) for start in range(0, count, per)]


def split(tensor: torch.Tensor, blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of a tensor's partitions (rows for 2+ dimensions, flat elements otherwise)."""
    if tensor.dim() >= 2:
        return [tensor.narrow(0, start, length) for start, length in blocks]
    flat = tensor.reshape(-1)
    return [flat.narrow(0, start, length) for start, length in blocks]


def part_name(name: str, index: int) -> str:
    """The name a partition's compressor state is kept under."""
    return f"{name}#{index}"


@dataclass(frozen=True)
class KeyLayout:
    """Where a declared tensor goes: its id, the shape and dtype it was declared with, its
    partitions as (start, length) blocks and each partition's key."""

    id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: list[tuple[int, int]]
    keys: list[int]
