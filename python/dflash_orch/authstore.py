"""The drafters' `torch.distributed` rendezvous across nodes, authenticated by the run's secret.

A TCPStore answers whoever connects, on every interface, and lets anyone list and write its
keys; another user could read a group's addresses or make every start fail. This store serves
the same operations (the ones gloo and NCCL use to form a group: set, get, add, compare_set,
wait, check, delete_key, num_keys) from a thread of global rank 0, bound to the one address given
(node 0's rendezvous host), and only to peers that prove they hold the key:

- on accept, the server sends a fresh 32-byte nonce; the client answers with its own nonce and
  HMAC-SHA256(key, "client" | both nonces); the server answers HMAC(key, "server" | both). A peer
  that fails, is silent for `HANDSHAKE_S` or sends anything malformed is dropped (said on stderr).
- every later frame, each way, is `length (4 bytes, big-endian) | payload | HMAC(session, direction
  | sequence number | payload)`, the session key derived from the key and both nonces: a
  replayed, reordered, truncated or forged frame ends the connection.

Payloads are JSON; values travel base64-encoded. Frames are at most `MAX_FRAME` bytes.
"""

import base64
import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time

import torch.distributed as dist

MAGIC = b"DFS1"
NONCE = 32
TAG = 32
MAX_FRAME = 16 << 20
HANDSHAKE_S = 10.0
# Unauthenticated connections served at once: more are closed at accept.
MAX_PENDING = 1024


def _mac(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock, n):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Channel:
    """One authenticated connection: framed, MAC'd, sequence-numbered messages."""

    def __init__(self, sock, session, sending, receiving):
        self.sock, self.session = sock, session
        self.sending, self.receiving = sending, receiving
        self.sent = self.received = 0

    def send(self, message):
        payload = json.dumps(message).encode()
        tag = _mac(self.session, self.sending, struct.pack(">Q", self.sent), payload)
        self.sent += 1
        self.sock.sendall(struct.pack(">I", len(payload)) + payload + tag)

    def receive(self):
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if n > MAX_FRAME:
            raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME})")
        payload = _recv_exact(self.sock, n)
        tag = _recv_exact(self.sock, TAG)
        want = _mac(self.session, self.receiving, struct.pack(">Q", self.received), payload)
        if not hmac.compare_digest(tag, want):
            raise ValueError("a frame whose MAC does not verify (forged, replayed or reordered)")
        self.received += 1
        message = json.loads(payload)
        if not isinstance(message, dict):
            raise ValueError("a frame that is not a JSON object")
        return message


def server_handshake(sock, key):
    nonce_s = os.urandom(NONCE)
    sock.sendall(MAGIC + nonce_s)
    reply = _recv_exact(sock, NONCE + TAG)
    nonce_c, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"client", nonce_s, nonce_c)):
        raise PermissionError("it does not hold the run's secret")
    sock.sendall(_mac(key, b"server", nonce_s, nonce_c))
    return Channel(sock, _mac(key, b"session", nonce_s, nonce_c), b"S", b"C")


def client_handshake(sock, key):
    hello = _recv_exact(sock, len(MAGIC) + NONCE)
    if hello[:len(MAGIC)] != MAGIC:
        raise PermissionError("the rendezvous does not speak the drafters' store protocol")
    nonce_s, nonce_c = hello[len(MAGIC):], os.urandom(NONCE)
    sock.sendall(nonce_c + _mac(key, b"client", nonce_s, nonce_c))
    try:
        proof = _recv_exact(sock, TAG)
    except ConnectionError:
        raise PermissionError("the rendezvous refused this process's key") from None
    if not hmac.compare_digest(proof, _mac(key, b"server", nonce_s, nonce_c)):
        raise PermissionError("the rendezvous does not hold the run's secret")
    return Channel(sock, _mac(key, b"session", nonce_s, nonce_c), b"C", b"S")


class StoreServer:
    """The key-value store, served to authenticated peers from daemon threads."""

    def __init__(self, host, port, key, log=None):
        self.key = bytes(key)
        self.data = {}
        self.cond = threading.Condition()
        self.pending = threading.BoundedSemaphore(MAX_PENDING)
        self.log = log or (lambda line: print(f"dflash_orch.authstore: {line}", file=sys.stderr))
        family, _, _, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(address)
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, name="authstore-accept", daemon=True).start()

    def close(self):
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self):
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            if not self.pending.acquire(blocking=False):
                self.log(f"dropped {peer[0]}:{peer[1]}: too many connections are authenticating")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn, peer):
        who = f"{peer[0]}:{peer[1]}"
        try:
            conn.settimeout(HANDSHAKE_S)
            try:
                channel = server_handshake(conn, self.key)
            finally:
                self.pending.release()
            conn.settimeout(None)
            while True:
                channel.send(self._answer(channel.receive()))
        except ConnectionError:
            pass  # a peer that left
        except (OSError, ValueError, PermissionError, KeyError, TypeError) as e:
            self.log(f"dropped {who}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            conn.close()

    def _answer(self, m):
        op = m["op"]
        with self.cond:
            if op == "set":
                self.data[str(m["key"])] = base64.b64decode(m["value"])
                self.cond.notify_all()
                return {}
            if op in ("get", "wait"):
                keys = [str(m["key"])] if op == "get" else [str(k) for k in m["keys"]]
                timeout = float(m["timeout"])
                if not self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout):
                    return {"error": f"keys {keys[:4]} not set within {timeout:g} s"}
                return {"value": base64.b64encode(self.data[keys[0]]).decode()} if op == "get" else {}
            if op == "add":
                value = int(self.data.get(str(m["key"]), b"0")) + int(m["amount"])
                self.data[str(m["key"])] = str(value).encode()
                self.cond.notify_all()
                return {"value": value}
            if op == "compare_set":
                key = str(m["key"])
                expected, desired = base64.b64decode(m["expected"]), base64.b64decode(m["desired"])
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self.data[key] = desired
                    self.cond.notify_all()
                    current = desired
                return {"value": base64.b64encode(current if current is not None else expected).decode()}
            if op == "check":
                return {"value": all(str(k) in self.data for k in m["keys"])}
            if op == "delete_key":
                return {"value": self.data.pop(str(m["key"]), None) is not None}
            if op == "num_keys":
                return {"value": len(self.data)}
        raise ValueError(f"unknown op {str(op)[:40]!r}")


def _bytes(value):
    return value.encode() if isinstance(value, str) else bytes(value)


class AuthStore(dist.Store):
    """A client of a StoreServer, usable as `init_process_group(store=...)`."""

    def __init__(self, host, port, key, timeout_s):
        super().__init__()
        self.key, self.timeout_s = bytes(key), float(timeout_s)
        self.lock = threading.Lock()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_S)
                sock.settimeout(HANDSHAKE_S)
                self.channel = client_handshake(sock, self.key)
                sock.settimeout(None)
                break
            except (ConnectionRefusedError, socket.timeout, ConnectionError) as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no drafters' store at {host}:{port} within "
                                       f"{self.timeout_s:g} s: {e}") from e
                time.sleep(0.1)

    def _call(self, **message):
        with self.lock:
            self.channel.send(message)
            answer = self.channel.receive()
        if "error" in answer:
            raise RuntimeError(f"the drafters' store: {str(answer['error'])[:300]}")
        return answer.get("value")

    def set(self, key, value):
        self._call(op="set", key=key, value=base64.b64encode(_bytes(value)).decode())

    def get(self, key):
        return base64.b64decode(self._call(op="get", key=key, timeout=self.timeout_s))

    def add(self, key, amount):
        return int(self._call(op="add", key=key, amount=int(amount)))

    def compare_set(self, key, expected, desired):
        return base64.b64decode(self._call(
            op="compare_set", key=key, expected=base64.b64encode(_bytes(expected)).decode(),
            desired=base64.b64encode(_bytes(desired)).decode()))

    def wait(self, keys, timeout=None):
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        self._call(op="wait", keys=list(keys), timeout=seconds)

    def check(self, keys):
        return bool(self._call(op="check", keys=list(keys)))

    def delete_key(self, key):
        return bool(self._call(op="delete_key", key=key))

    def num_keys(self):
        return int(self._call(op="num_keys"))


def key_from_env(name="DFLASH_DRAFTERS_KEY"):
    """The group's key (hex in `name`), removed from the environment so that nothing this
    process starts inherits it; None when unset."""
    text = os.environ.pop(name, None)
    if text is None:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{name} is not hex") from None
    if len(key) < 16:
        raise ValueError(f"{name} holds {len(key)} bytes; the key needs at least 16")
    return key
