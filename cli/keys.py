"""``murmura keys`` and ``murmura certs``: a node's identity key, and a small CA with server
and client certificates for TLS and mutual TLS (docs/security.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["cmd_certs", "cmd_keys"]


def cmd_keys(args: argparse.Namespace) -> int:
    from murmura.protocols.identity import NodeKey

    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out} is a directory; name the key FILE inside it")
    try:  # `--out keys/node.key` in a fresh checkout: make keys/ (as `certs` makes its DIR)
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "a file is in the way" if isinstance(exc, FileExistsError) else exc.strerror
        raise ValueError(f"cannot create the directory of --out {args.out}: {why}") from None
    key = NodeKey.generate()
    pub = key.save(out)
    print(f"wrote {args.out} (private, mode 0600) and {pub}")
    print(f"client id  {key.client_id}")
    print(f"public key {key.public_hex}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from murmura.protocols import tls

    if args.certs_command == "init":
        cert, key = tls.make_ca(args.out)
        print(f"wrote {cert} (give it to clients: --tls-ca; to the server: --client-ca) "
              f"and {key} (keep it secret)")
    elif args.certs_command == "server":
        hosts = [h.strip() for h in args.host.split(",") if h.strip()]
        cert, key = tls.make_server_cert(args.ca, args.out, hosts)
        print(f"wrote {cert} and {key} for {', '.join(hosts)} "
              f"(murmura server --tls-cert {cert} --tls-key {key})")
    else:
        cert, key = tls.make_client_cert(args.ca, args.out, args.name)
        print(f"wrote {cert} and {key} (murmura client --tls-cert {cert} --tls-key {key})")
    return 0
