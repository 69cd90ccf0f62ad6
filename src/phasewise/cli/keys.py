"""``phasewise keys submitter PATH``: make a submitter's Ed25519 key pair, PATH (private, mode 0600) and PATH.pub.

Never overwrites a file; docs/security.md ("Who may start a job") says where each key goes.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    s = sub.add_parser("submitter", help="a submitter's Ed25519 key pair: PATH (private, 0600) and PATH.pub",
                       description="Write a new submitter key to PATH (mode 0600) and its public key to PATH.pub.")
    s.add_argument("path", metavar="PATH", help="the private key file to create (PATH.pub is its public key)")


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.job_signing import JobSigningError, write_key_pair

    try:
        kid = write_key_pair(args.path)
    except JobSigningError as e:
        print(f"phasewise keys: error: {e}", file=sys.stderr)
        return 2
    print(f"submitter key {kid}: private {args.path} (mode 600; for phasewise submit --key or "
          f"PHASEWISE_JOB_SUBMITTER_KEY_FILE), public {args.path}.pub (for an actuator's "
          f"PHASEWISE_JOB_TRUSTED_SUBMITTERS)")
    return 0
