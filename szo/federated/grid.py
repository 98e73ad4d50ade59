"""Flower's ServerApp / ClientApp on loopback sockets: a ``Grid`` for the server, a node loop per client process.

Flower 1.42 offers two runtimes for a ``ServerApp`` and its ``ClientApp`` s, and neither fits a
test suite on a 2-core machine without Ray: the simulation engine runs ClientApps only on Ray
(``flwr[simulation]``), and the deployment engine (``flower-superlink`` + ``flower-supernode``)
starts a fresh ``flwr-clientapp`` process for every message, loading the app from a FAB that
``flwr run`` installs under ``FLWR_HOME`` -- SecAgg+ sends four messages per client and round,
so every round would import torch four times per client. Here the ServerApp drives a
:class:`LoopbackGrid` (a :class:`flwr.serverapp.Grid`: the object a ServerApp's workflows talk
to), and every client process keeps one ``ClientApp`` (with its mods, e.g. ``secaggplus_mod``)
and one ``Context`` for the whole run and answers its messages in turn (:func:`serve_node`).

On the wire: Flower's own protobuf ``Message`` (``flwr.common.serde``), one length-prefixed
frame per message, on ``127.0.0.1``; the grid counts the frames' bytes per message group (the
round). A node whose connection closes (its process died or left) is gone from
:meth:`LoopbackGrid.get_node_ids` at once, and the messages it still owed are not waited for:
the workflow sees a dropout, not a hang.

Clients are not trusted, nor is anything else on the machine that can open a loopback socket:

* every connection authenticates before it becomes a node: the grid draws a secret per run and
  derives one key per client from it (:meth:`LoopbackGrid.client_key`, handed to the client
  process it starts, on its stdin); the grid opens with a random challenge and the peer answers
  ``{"cid": c, "mac": HMAC-SHA256(key_c, challenge)}``. A peer without client ``c`` 's key (an
  impostor saying hello as client 0 first) is refused in one line and the real client still gets in;
* a reply is accepted only from the connection of the node it was sent to, as the answer to a
  message that node still owes, from that node (its ``src_node_id``) and in the request's group;
* ``screen(request, reply)`` (the federation's upload checks) sees every reply before the
  workflow does: a reply it objects to is discarded, its node is dropped from the grid with one
  warning line naming it and the reason, and the workflow sees that node as a dropout.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import sys
import threading
import time
import traceback
import uuid
from collections import defaultdict
from typing import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LoopbackGrid", "run_server_app", "serve_node", "node_id_of", "cid_of", "NODE_ID_BASE", "Screen"]

NODE_ID_BASE = 1000
"""Client ``c`` is Flower node ``NODE_ID_BASE + c`` (never the SuperLink's id 1)."""
_LEN = struct.Struct("!Q")
_MAX_FRAME = 1 << 31
_MAX_HELLO = 1 << 12  # an unauthenticated peer's frame: a small JSON object
HANDSHAKE_TIMEOUT_S = 10.0
"""A connection that has not authenticated within this is closed."""

Screen = Callable[[Message, Message], "str | None"]
"""``screen(request, reply)``: None to pass the reply on, else why it is refused (one line)."""


def node_id_of(cid: int) -> int:
    return NODE_ID_BASE + int(cid)


def cid_of(node_id: int) -> int:
    """The client id of Flower node ``node_id`` (:func:`node_id_of` inverted)."""
    return int(node_id) - NODE_ID_BASE


def _mac(key: str, challenge: str) -> str:
    return hmac.new(bytes.fromhex(key), bytes.fromhex(challenge), hashlib.sha256).hexdigest()


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int = _MAX_FRAME) -> bytes | None:
    """One frame of at most ``limit`` bytes, or None when the peer closed the connection."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ValueError(f"a frame of {n} bytes announced (at most {limit} here): not a szo federation peer")
    return _recv_exact(sock, n)


class LoopbackGrid(Grid):
    """The server's side: listens on ``127.0.0.1`` (a free port, :attr:`address`), one
    authenticated connection per client process (module docstring), Flower messages both ways.

    :attr:`bytes` maps a message group (Flower's round number, as a string) to ``[down, up]``:
    the serialized protobuf bytes of every message sent to and received from the nodes.
    ``screen``: the check every reply passes before a workflow sees it (:data:`Screen`);
    :attr:`dropped` lists ``(node id, message group, why)`` of the nodes dropped (:meth:`drop_node`)."""

    def __init__(self, run_id: int = 1, host: str = "127.0.0.1", screen: Screen | None = None) -> None:
        self._run = Run.create_empty(run_id)
        self._secret = secrets.token_bytes(32)  # this run's: the client keys derive from it
        self.screen = screen
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._cv = threading.Condition()
        self._conns: dict[int, socket.socket] = {}  # live nodes
        self._send_locks: dict[int, threading.Lock] = {}
        self._owed: dict[str, int] = {}  # message id -> node that owes the reply
        self._groups: dict[str, str] = {}  # message id -> its group (the round)
        self._replies: dict[str, Message] = {}  # message id -> its reply
        self.bytes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.gone: list[int] = []  # node ids whose connection closed, in order
        self.dropped: list[tuple[int, str | None, str]] = []  # (node id, group, why) of dropped nodes
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="szo-grid-accept").start()

    def client_key(self, cid: int) -> str:
        """Client ``cid`` 's key (hex) for this run: what its process proves it holds when it
        connects. Give it to that client only (e.g. on its stdin, not its command line)."""
        return hmac.new(self._secret, f"szo-federation-client-{int(cid)}".encode(), hashlib.sha256).hexdigest()

    # --------------------------------------------------------------- connections
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True, name="szo-grid-node").start()

    def _authenticate(self, conn: socket.socket) -> int:
        """The challenge and the peer's answer (module docstring): its client id, or ValueError."""
        challenge = secrets.token_hex(32)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        _send_frame(conn, json.dumps({"challenge": challenge}).encode())
        hello = _recv_frame(conn, _MAX_HELLO)
        try:
            hello = json.loads(hello) if hello is not None else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            hello = None
        cid = hello.get("cid") if isinstance(hello, dict) else None
        if isinstance(cid, bool) or not isinstance(cid, int) or cid < 0:
            raise ValueError(f"refused a peer that said hello without a valid client id ({cid!r})")
        mac = hello.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self.client_key(cid), challenge)):
            raise ValueError(f"refused a peer that said hello as client {cid} without its key (an impostor, or a "
                             "client of another run)")
        conn.settimeout(None)
        return cid

    def _serve_conn(self, conn: socket.socket) -> None:
        node = None
        try:
            cid = self._authenticate(conn)
            with self._cv:
                if node_id_of(cid) in self._conns or self._closed:
                    raise ValueError(f"client {cid} connected twice")
                node = node_id_of(cid)
                self._conns[node], self._send_locks[node] = conn, threading.Lock()
                self._cv.notify_all()
            while (data := _recv_frame(conn)) is not None:
                msg = message_from_proto(ProtoMessage.FromString(data))
                mid, md = msg.metadata.reply_to_message_id, msg.metadata
                with self._cv:
                    self.bytes[md.group_id][1] += len(data)
                    if self._owed.get(mid) != node or md.src_node_id != node or self._groups.get(mid) != md.group_id:
                        print(f"warning: federation: a reply from client {cid} to no message it owes now (late, "
                              "or in another's name or round): ignored", file=sys.stderr, flush=True)
                        continue
                    self._replies[mid] = msg
                    self._cv.notify_all()
        except Exception as e:  # noqa: BLE001 - an untrusted peer's connection fails alone, never the server
            if not self._closed and node not in {n for n, _, _ in self.dropped}:
                print(f"warning: federation: a client connection failed: {e}", file=sys.stderr, flush=True)
        finally:
            with self._cv:
                if node is not None and self._conns.get(node) is conn:
                    del self._conns[node]
                    self.gone.append(node)
                self._cv.notify_all()
            conn.close()

    def wait_for_nodes(self, n: int, timeout_s: float, check: Callable[[], None] = lambda: None) -> None:
        """Block until ``n`` nodes are connected; ``check()`` (called every 0.1 s) may raise,
        e.g. when a client process has exited; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while len(self._conns) < n:
                check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(self._conns)} of {n} clients connected within {timeout_s:g} s")
                self._cv.wait(0.1)

    def drop_node(self, node_id: int, why: str, group: str | None = None) -> None:
        """Refuse node ``node_id`` for the rest of the run (in message group ``group``, the round):
        one warning line, its connection closed (its process sees the server go and stops), the
        messages it owes not waited for."""
        with self._cv:
            conn = self._conns.pop(node_id, None)
            if conn is None:
                return
            self.gone.append(node_id)
            self.dropped.append((node_id, group, why))
            self._cv.notify_all()
        print(f"warning: federation: client {cid_of(node_id)} dropped: {why}", file=sys.stderr, flush=True)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Close every connection (the nodes see it and stop) and the listening socket."""
        with self._cv:
            self._closed = True
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.close()

    # --------------------------------------------------------------- flwr.serverapp.Grid
    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be a flwr Run, got {type(run).__name__}")
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        with self._cv:
            return sorted(self._conns)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            proto = message_to_proto(msg)
            mid = uuid.uuid4().hex
            proto.metadata.message_id, proto.metadata.run_id = mid, self._run.run_id
            proto.metadata.src_node_id = SUPERLINK_NODE_ID
            data = proto.SerializeToString()
            dst = msg.metadata.dst_node_id
            with self._cv:
                conn, lock = self._conns.get(dst), self._send_locks.get(dst)
                self._owed[mid], self._groups[mid] = dst, msg.metadata.group_id
            ids.append(mid)
            if conn is None:
                continue  # a node that is gone: nothing will come back
            try:
                with lock:
                    _send_frame(conn, data)
                with self._cv:
                    self.bytes[msg.metadata.group_id][0] += len(data)
            except OSError:
                pass  # its reader sees the closed connection and drops the node
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._cv:
            out = [self._replies.pop(m) for m in message_ids if m in self._replies]
            for msg in out:
                self._owed.pop(msg.metadata.reply_to_message_id, None)
                self._groups.pop(msg.metadata.reply_to_message_id, None)
            return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push, then wait until every message is answered, its node is gone, or ``timeout``;
        every reply passes ``screen`` (a refused one is not returned and its node is dropped)."""
        messages = list(messages)
        sent = dict(zip(self.push_messages(messages), messages))
        ids = set(sent)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                waiting = [m for m in ids if m not in self._replies and self._owed.get(m) in self._conns]
                if not waiting or (deadline is not None and time.monotonic() >= deadline):
                    break
                self._cv.wait(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
            for m in ids:  # unanswered: forget them (a late reply is ignored)
                if m not in self._replies:
                    self._owed.pop(m, None)
                    self._groups.pop(m, None)
        replies = list(self.pull_messages(ids))
        if self.screen is None:
            return replies
        out = []
        for reply in replies:
            why = None if reply.has_error() else self.screen(sent[reply.metadata.reply_to_message_id], reply)
            if why is None:
                out.append(reply)
            else:
                self.drop_node(reply.metadata.src_node_id, why, reply.metadata.group_id)
        return out


def serve_node(address: str, cid: int, app: Callable[[Message, Context], Message], key: str) -> None:
    """One client process's node: connect to the :class:`LoopbackGrid` at ``address`` as client
    ``cid`` (answering its challenge with ``key``, :meth:`LoopbackGrid.client_key`), answer every
    message with ``app(message, context)`` (a Flower ``ClientApp``; one ``Context`` for the whole
    run, so mods such as ``secaggplus_mod`` keep their state between stages) until the server
    closes the connection. An exception in the app is answered with a Flower ``Error`` (the
    workflow counts the node as failed for that message) and printed here."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    context: Context | None = None
    try:
        first = _recv_frame(sock, _MAX_HELLO)
        if first is None:
            return
        challenge = json.loads(first)["challenge"]
        _send_frame(sock, json.dumps({"cid": int(cid), "mac": _mac(key, challenge)}).encode())
        while (data := _recv_frame(sock)) is not None:
            msg = message_from_proto(ProtoMessage.FromString(data))
            if context is None:
                context = Context(run_id=msg.metadata.run_id, node_id=node_id_of(cid), node_config={},
                                  state=RecordDict(), run_config={})
            try:
                reply = app(msg, context)
            except Exception as e:  # noqa: BLE001 - reported to the server as Flower's error reply
                if isinstance(e, ValueError):  # a client's own refusal (e.g. over clip_range): its line
                    print(f"warning: client {cid}: {e}", file=sys.stderr, flush=True)
                else:
                    traceback.print_exc()
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(e).__name__}: {e}"),
                                reply_to=msg)
            proto = message_to_proto(reply)
            proto.metadata.message_id = uuid.uuid4().hex
            _send_frame(sock, proto.SerializeToString())
    except ConnectionError:
        pass  # the server went away: nothing left to answer
    finally:
        sock.close()


def run_server_app(app: Callable[..., None], grid: LoopbackGrid) -> None:
    """Run a Flower ``ServerApp`` against ``grid`` in this process, as Flower's runtimes do: the
    process's task identity (the sender of the messages the workflows create) is the SuperLink's
    node, the run is the grid's; the app gets a fresh ``Context``."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, grid.run.run_id, SUPERLINK_NODE_ID
    app(grid, Context(run_id=grid.run.run_id, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(),
                      run_config={}))
