"""Channel security for both ends of the wire: TLS, mutual TLS and a bearer token. All three are off by default.

* TLS: the shard serves with ``--tls-cert``/``--tls-key``. A client turns
  TLS on by passing the CA that signed the shard's certificate (``--tls-ca``)
  and checks the shard against it. The certificate must name the host the
  client dials (an IP SAN for ``127.0.0.1``, a DNS SAN for a name).
* Mutual TLS: a shard given ``--tls-ca`` as well asks for a client
  certificate signed by that CA (``--tls-cert``/``--tls-key`` on the client
  side) and refuses the handshake without one.
* Bearer token: a shard given ``--auth-token-file`` refuses every
  ``shardps.v1.Shard`` call that does not carry the metadata
  ``authorization: Bearer <token>`` (``shardps.server.auth``). The token is
  the file's contents with whitespace stripped. Clients send it on every call.
  Without TLS it would travel in clear text, where one sniffed request is
  enough to act as any worker or operator: both ends refuse that unless the
  peer is a loopback address (:func:`is_loopback_host`) or the operator
  says ``--allow-token-over-plaintext`` (``ChannelSecurity(...,
  allow_token_over_plaintext=True)``, ``ShardConfig.allow_token_over_plaintext``),
  which logs a WARNING. gRPC itself refuses to send call credentials over an
  insecure channel; shardps's interceptor follows the same rule.

``grpc.health.v1.Health`` needs no token. A failed TLS handshake looks like an
unreachable server to gRPC (UNAVAILABLE, or a connect timeout). A missing or
wrong token gets UNAUTHENTICATED.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

#: gRPC metadata key that carries the token (lower case: HTTP/2 header names are).
AUTH_METADATA_KEY = "authorization"
#: Authorization scheme: the metadata value is ``"Bearer <token>"``.
AUTH_SCHEME = "Bearer"

#: The flag (and, with underscores, the ``ChannelSecurity``/``ShardConfig`` field) that lets a token go over plaintext.
INSECURE_FLAG = "--allow-token-over-plaintext"

_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKER = b"PRIVATE KEY-----"


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read the file ({exc.strerror or exc})") from None


def read_pem(path: str, flag: str, *, key: bool = False) -> bytes:
    """The PEM bytes of certificate file ``path``, or of a private key file when ``key`` is true.

    ``flag`` is the command-line flag the path came from; error messages name it.
    Only the PEM markers are checked here. gRPC parses the contents when the
    channel or server first uses them.

    Raises:
        ValueError: the file is missing, unreadable, or holds no PEM certificate (or no PEM private key).
    """
    data = _read(path, flag)
    if key and _KEY_MARKER not in data:
        raise ValueError(f"{flag} {path}: no PEM private key in the file (expected '-----BEGIN ... PRIVATE KEY-----')")
    if not key and _CERT_MARKER not in data:
        raise ValueError(f"{flag} {path}: no PEM certificate in the file (expected '{_CERT_MARKER.decode()}')")
    return data


def _token_problem(token: str) -> str | None:
    if not token:
        return "the token is empty"
    if not all("!" <= c <= "~" for c in token):
        return (f"the token must be visible ASCII characters only, without spaces or line breaks inside it "
                f"({len(token)} characters given)")
    return None


def check_token(token: str, flag: str = "--auth-token-file") -> str:
    """Return ``token`` unchanged if it can travel in an HTTP/2 header.

    Raises:
        ValueError: the token is empty or holds anything but visible ASCII
            characters (no spaces). The token itself never appears in the message.
    """
    if problem := _token_problem(token):
        raise ValueError(f"{flag}: {problem}")
    return token


def read_token_file(path: str, flag: str = "--auth-token-file") -> str:
    """The bearer token in file ``path``: its contents with surrounding whitespace stripped.

    Raises:
        ValueError: the file is missing, unreadable or not UTF-8, or the token is empty or malformed (see
            :func:`check_token`).
    """
    try:
        token = _read(path, flag).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: the file is not UTF-8 text") from None
    if problem := _token_problem(token):
        raise ValueError(f"{flag} {path}: {problem}")
    return token


def address_hosts(address: str) -> list[str]:
    """The hosts of a gRPC target: ``host:port``, ``[v6]:port``, ``dns:///host:port``, ``ipv4:a.b.c.d:p,...``.

    A ``unix:`` target gives ``[""]`` (a socket on this machine).
    """
    target = address.strip()
    if target.startswith(("unix:", "unix-abstract:")):
        return [""]
    parts = [target]
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            parts = target[len(scheme):].split(",")
            break
    hosts = []
    for part in parts:
        if part.startswith("["):
            hosts.append(part[1 : part.index("]")] if "]" in part else part)
        else:
            hosts.append(part.rpartition(":")[0] if ":" in part else part)
    return hosts


def _loopback_ip(text: str) -> bool:
    ip = ipaddress.ip_address(text.split("%")[0])  # drop an IPv6 zone
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def is_loopback_host(host: str) -> bool:
    """Whether every address ``host`` stands for is a loopback address (``127.0.0.0/8``, ``::1``).

    An IP literal is judged as is; a name is resolved (``getaddrinfo``) and
    all of its addresses must be loopback. ``""`` (a ``unix:`` socket) counts
    as loopback. ``0.0.0.0`` and ``::`` (every interface) are not loopback,
    nor is a name that does not resolve.
    """
    if host == "":
        return True
    try:
        return _loopback_ip(host)
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(_loopback_ip(a) for a in found)


def token_over_plaintext_problem(host: str, who: str) -> str | None:
    """Why a bearer token must not travel in plaintext to or from ``host``; None when ``host`` is loopback.

    ``who`` names the side in the message (``"shardps-server"``, or the command).
    """
    if is_loopback_host(host):
        return None
    return (f"{who}: a bearer token (--auth-token-file) over plaintext to or from {host!r}, which is not a "
            "loopback address, can be read by anyone on the network path and replayed to act as any worker "
            "or operator: use TLS (--tls-cert/--tls-key on the shards, --tls-ca on the clients), or pass "
            f"{INSECURE_FLAG} (allow_token_over_plaintext=True) to send it in clear text anyway")


_warned: set[str] = set()


def warn_token_over_plaintext(host: str, who: str) -> None:
    """Log the WARNING of an allowed token over plaintext to a non-loopback ``host`` (once per host and side)."""
    if (who, host) in _warned or is_loopback_host(host):
        return
    _warned.add((who, host))
    log.warning("%s: the bearer token travels in clear text to or from %r (%s): anyone on the network path can "
                "read and replay it; use TLS on any network you do not control", who, host, INSECURE_FLAG)


def server_credentials(cert_file: str, key_file: str, ca_file: str = "") -> grpc.ServerCredentials:
    """TLS credentials for a shard: its certificate chain and key and, for mutual TLS, the clients' CA.

    Args:
        cert_file: PEM certificate (chain) of the shard (``--tls-cert``).
        key_file: PEM private key of that certificate (``--tls-key``).
        ca_file: PEM CA bundle (``--tls-ca``). When given, clients must present a
            certificate signed by it (``require_client_auth``). Empty: any client may connect.

    Raises:
        ValueError: a file is missing, unreadable or not PEM (the message names the flag), or only
            one of ``cert_file`` and ``key_file`` is given.
    """
    if bool(cert_file) != bool(key_file):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if not cert_file:
        raise ValueError("server TLS needs --tls-cert and --tls-key")
    cert, key = read_pem(cert_file, "--tls-cert"), read_pem(key_file, "--tls-key", key=True)
    ca = read_pem(ca_file, "--tls-ca") if ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    """A call's details with the token added to its metadata."""


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to the metadata of every call, of all four kinds."""

    def __init__(self, token: str) -> None:
        self._metadata = ((AUTH_METADATA_KEY, f"{AUTH_SCHEME} {token}"),)

    def __repr__(self) -> str:
        return "_BearerToken(<hidden>)"

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches the shards: plaintext (every field None), TLS, mutual TLS, and/or a bearer token.

    Attributes:
        ca: PEM CA bundle that the shards' certificates must chain to. Set: TLS. None: plaintext.
        cert, key: PEM client certificate (chain) and private key for mutual TLS. Give both or neither,
            and only together with ``ca``.
        token: bearer token sent as ``authorization: Bearer <token>`` on every call. None: no token.
        allow_token_over_plaintext: let :meth:`channel` send ``token`` without TLS to an address that is
            not loopback (logs a WARNING once per host). False (default): such a channel is refused.

    ``key`` and ``token`` are left out of ``repr``.

    Raises:
        ValueError: ``cert`` without ``key`` or the other way round, a client certificate without
            ``ca``, or an empty or malformed token.
    """

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    allow_token_over_plaintext: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.cert is not None and self.ca is None:
            raise ValueError("a client certificate (--tls-cert/--tls-key) needs --tls-ca too: "
                             "a TLS client must verify the shard's certificate")
        if self.token is not None:
            check_token(self.token)

    @property
    def tls(self) -> bool:
        """Whether channels use TLS."""
        return self.ca is not None

    @classmethod
    def from_files(cls, tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                   auth_token_file: str = "", allow_token_over_plaintext: bool = False) -> "ChannelSecurity":
        """Read the PEM files and the token file that the flags of the same names point to ("" = not given).

        Raises:
            ValueError: a file is missing, unreadable, not PEM, or the token file is empty (the message
                names the flag); ``tls_cert`` without ``tls_key`` or the other way round; a client
                certificate without ``tls_ca``.
        """
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if tls_cert and not tls_ca:
            raise ValueError("a client certificate (--tls-cert/--tls-key) needs --tls-ca too: "
                             "a TLS client must verify the shard's certificate")
        return cls(
            ca=read_pem(tls_ca, "--tls-ca") if tls_ca else None,
            cert=read_pem(tls_cert, "--tls-cert") if tls_cert else None,
            key=read_pem(tls_key, "--tls-key", key=True) if tls_key else None,
            token=read_token_file(auth_token_file) if auth_token_file else None,
            allow_token_over_plaintext=allow_token_over_plaintext,
        )

    def channel(self, address: str, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
        """A channel to ``address`` (``host:port``) with ``options`` (``shardps.common.transport.channel_options``).

        The channel uses TLS when ``ca`` is set (mutual TLS with ``cert``/``key``) and is plaintext otherwise.
        When ``token`` is set, an interceptor adds it to the metadata of every call. The returned channel
        supports ``grpc.channel_ready_future``, the four call kinds, and ``close()``, which closes the
        underlying channel.

        Raises:
            ValueError: ``token`` is set, the channel is plaintext and ``address`` is not loopback
                (:func:`is_loopback_host`), without ``allow_token_over_plaintext``; the message names
                the fix. Nothing is sent.
        """
        if self.token is not None and self.ca is None:
            for host in address_hosts(address):
                if self.allow_token_over_plaintext:
                    warn_token_over_plaintext(host, "client")
                elif problem := token_over_plaintext_problem(host, f"connecting to {address}"):
                    raise ValueError(problem)
        options = list(options or ())
        if self.ca is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                       certificate_chain=self.cert)
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token is not None:
            channel = grpc.intercept_channel(channel, _BearerToken(self.token))
        return channel
