"""``python -m kvpolicy.eval.lmeval`` (also ``kvpolicy-lm-eval``): lm-eval's command line, with
the ``kvpolicy`` model registered."""

from __future__ import annotations

import sys


def main() -> None:
    """Run lm-eval's CLI (``lm_eval ...`` arguments) with ``--model kvpolicy`` available."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        sys.exit(f"kvpolicy-lm-eval needs lm-evaluation-harness: pip install 'kvpolicy[bench]' ({exc})")
    from . import KVPolicyLM  # noqa: F401  (registers the model)

    cli_evaluate()


if __name__ == "__main__":
    main()
