"""How a replica group that joins a live run (torchft: a quorum per step, replica groups that come and go) gets the
training state from a live peer, without unpickling anything.

torchft's own transports unpickle what a peer sends: HTTPTransport loads it with `torch.load(weights_only=False)`,
PGTransport with `pickle.loads`. Anything that can answer on the port a joiner is pointed at could then run code in
it. SafeHTTPTransport sends the same state as two parts that only describe data: the tensors as safetensors, and the
structure around them (dicts with str or int keys, in their order; lists, tuples, numbers, strings, booleans, None)
as JSON. A state holding anything else is refused when it is sent, naming the key path.

The sender serializes at `send_checkpoint` (the trainer may change its state once `disallow_checkpoint` returns),
so a heal holds a second copy of the state in host memory while a joiner fetches it."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torchft.checkpointing.transport import CheckpointTransport

SCALARS = (int, float, str, bool, type(None))


def encode(state: object) -> tuple[str, bytes]:
    """`state` as (JSON of its structure, safetensors of its tensors); a leaf of another type raises TypeError."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: object, path: str) -> object:
        if isinstance(node, torch.Tensor):
            if type(node) is not torch.Tensor:  # a DTensor, a subclass: its local part would not be the state
                raise TypeError(f"state{path}: a {type(node).__name__}, not a plain tensor")
            name = str(len(tensors))
            tensors[name] = node.detach().to("cpu", copy=True).contiguous()
            return {"tensor": name}
        if isinstance(node, dict):
            for key in node:
                if type(key) not in (str, int):
                    raise TypeError(f"state{path}: a key of type {type(key).__name__}")
            return {"dict": [[key, walk(value, f"{path}[{key!r}]")] for key, value in node.items()]}
        if type(node) in (list, tuple):  # not a namedtuple, whose type a heal does not carry
            return {type(node).__name__: [walk(value, f"{path}[{i}]") for i, value in enumerate(node)]}
        if isinstance(node, SCALARS):
            return {"value": node}
        raise TypeError(f"state{path}: a {type(node).__name__}, which a heal does not send")

    structure = json.dumps(walk(state, ""))
    return structure, save_tensors(tensors)


def decode(structure: str, blob: bytes) -> object:
    """The state `encode` gave (str or int dict keys, lists, tuples, tensors on the CPU)."""
    tensors = load_tensors(blob)

    def build(node: dict) -> object:
        (kind, value), = node.items()
        if kind == "tensor":
            return tensors[value]
        if kind == "dict":
            return {key: build(child) for key, child in value}
        if kind in ("list", "tuple"):
            items = [build(child) for child in value]
            return items if kind == "list" else tuple(items)
        if kind == "value" and isinstance(value, SCALARS):
            return value
        raise ValueError(f"a heal's structure holds an unknown node {kind!r}")

    return build(json.loads(structure))


class SafeHTTPTransport(CheckpointTransport[dict]):
    """torchft's CheckpointTransport over HTTP: a live replica serves the step it sends (GET
    /checkpoint/STEP/structure and /checkpoint/STEP/tensors) until `disallow_checkpoint`; a joiner fetches both.
    `host`: the name or address the other groups reach this one by (default: this host's name, which some
    networks do not resolve to the address that reaches it)."""

    def __init__(self, timeout: timedelta, host: str | None = None):
        self._timeout, self.host = timeout, host or socket.gethostname()
        self._served: tuple[int, bytes, bytes] | None = None  # step, structure, tensors
        self._ready = threading.Condition()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = self.path.strip("/").split("/")
                body = transport._wait_for(parts)
                if body is None:
                    self.send_error(404, f"not served: {self.path}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # one line per fetch is noise in a run's log
                pass

        self._server = ThreadingHTTPServer(("", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _wait_for(self, parts: list[str]) -> bytes | None:
        """The part a request names, once its step is served (a joiner may ask before the sender serves)."""
        if len(parts) != 3 or parts[0] != "checkpoint" or parts[2] not in ("structure", "tensors"):
            return None
        with self._ready:
            served = self._ready.wait_for(lambda: self._served is not None and str(self._served[0]) == parts[1],
                                          timeout=self._timeout.total_seconds())
            if not served:
                return None
            _, structure, tensors = self._served
        return structure if parts[2] == "structure" else tensors

    def metadata(self) -> str:
        return f"http://{self.host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        structure, tensors = encode(state_dict)
        with self._ready:
            self._served = step, structure.encode(), tensors
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._served = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a peer: never through a proxy

        def fetch(part: str) -> bytes:
            with direct.open(f"{metadata}{step}/{part}", timeout=timeout.total_seconds()) as response:
                return response.read()

        return decode(fetch("structure").decode(), fetch("tensors"))

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
