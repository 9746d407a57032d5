"""The ``kvpolicy`` command: list, show, validate policies, print the policy-file schema, evaluate,
compute head profiles.

Exit codes: 0 on success, 1 when ``validate`` finds an invalid (or missing) file, 2 for a usage
error or a policy that cannot be loaded (printed to stderr on one line, ``kvpolicy: error: ...``,
without a traceback), 141 when the reader of the output left (a shell's code for SIGPIPE).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from . import __version__
from .config import PolicyConfig
from .documents import PolicyError, load_yaml
from .files import check_output, replace_file
from .loading import load_policy
from .policy import Policy
from .registry import PluginLoadWarning, Registry, UnknownStageError, get_registry
from .schema import first_sentence, policy_json_schema
from .stages.base import STAGE_KINDS

EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left
_LINE_PREFIX = re.compile(r"^line (\d+)(?:, column (\d+))?: ")


class CommandError(Exception):
    """A user error the command reports on one line and exits with ``EXIT_USAGE``."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return int(args.func(args) or 0)
        except BrokenPipeError:  # the reader left (`kvpolicy policies | head`): not an error to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet too
            return EXIT_BROKEN_PIPE
        except PolicyError as exc:
            _error("; ".join(locate_problem(exc.source, p) for p in exc.problems) or str(exc))
            return EXIT_USAGE
        except (UnknownStageError, CommandError, OSError) as exc:
            _error(str(exc))
            return EXIT_USAGE
        except KeyboardInterrupt:
            _error("interrupted")
            return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy",
        description="Composable KV-cache eviction policies: list, inspect, validate and evaluate them.",
    )
    parser.add_argument("--version", action="version", version=f"kvpolicy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "policies",
        help="list registered policies and stages, a line each (the whole text: show NAME)",
        description="List the registered policies, a line each (name, source plugin, mode, budget, summary), "
        "then the stages. A filter lists the matching policies only.",
        epilog="--needs:\n" + "\n".join(f"  {need:<12} {text}" for need, (text, _) in NEEDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--source", metavar="PLUGIN",
                   help="only the policies of this plugin package (builtin: those kvpolicy ships)")
    p.add_argument("--mode", choices=POLICY_MODES, help="only the policies of this mode")
    p.add_argument("--needs", choices=tuple(NEEDS), help="only the policies that need this (see below)")
    p.add_argument("--json", action="store_true",
                   help="print the (filtered) policies as a JSON list, whole descriptions included")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("show", help="print a policy resolved, as YAML (defaults and overrides applied)")
    p.add_argument("policy", metavar="NAME_OR_FILE", help="a registered policy name or a YAML file")
    p.add_argument("--budget", type=int, help="override schedule.budget")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a schedule or top-level field (recent, interval, window, count, "
        "compress_prompt, seed, name); repeatable; VALUE is read as YAML",
    )
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("validate", help="check policy files; report file:line: field: problem")
    p.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files (or registered names)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "schema",
        help="print the JSON schema of a policy file (plugin stages included), for editor completion",
    )
    p.add_argument("--output", "-o", type=Path, metavar="FILE", help="write it to FILE instead of stdout")
    p.set_defaults(func=cmd_schema)

    _add_profile(sub)
    _add_calibrate(sub)
    _add_eval(sub)
    return parser


# -- commands -------------------------------------------------------------------------------------
#: The modes a policy file may name (``PolicyConfig.mode``): ``kvpolicy policies --mode`` offers these.
POLICY_MODES: tuple[str, ...] = typing.get_args(PolicyConfig.model_fields["mode"].annotation)

#: ``kvpolicy policies --needs``: what a policy needs besides the cache's tensors, as its stages
#: declare it (nested stages included), and a line on each for ``--help``.
NEEDS: dict[str, tuple[str, Callable[[Policy], bool]]] = {
    "model-facts": ("facts of the model: RoPE, the output projection (Stage.needs_model)",
                    lambda policy: bool(policy.needs_model)),
    "state": ("per-token state kept across evictions (Stage.state_fields)", lambda policy: policy.keeps_state),
    "calibration": ("a data file measured on a model: a query calibration, a head profile (Stage.data_files)",
                    lambda policy: bool(policy.data_files)),
}

#: ``--source builtin`` names the policies kvpolicy ships, registered under the plugin name ``kvpolicy``.
BUILTIN_SOURCE = ("builtin", "kvpolicy")


def policy_summary(config: PolicyConfig) -> str:
    """A policy's few words for ``kvpolicy policies``: its ``summary``, else its description's
    first clause (``first_clause``)."""
    return config.summary or first_clause(config.description)


def first_clause(text: str | None) -> str:
    """A description's first clause: its first sentence, up to a semicolon, and past a short
    heading (``"H2O (Heavy-Hitter Oracle): keep ..."`` gives ``"keep ..."``); semicolons and
    colons inside brackets do not count."""
    sentence = first_sentence(text)
    depth, head_end = 0, -1
    for i, char in enumerate(sentence):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0 and char == ";":
            sentence = sentence[:i]
            break
        if depth == 0 and head_end < 0 and sentence.startswith(": ", i):
            head_end = i
    rest = sentence[head_end + 2 :].strip() if 0 <= head_end <= 40 else ""
    return rest or sentence.strip()


def _cut(text: str, room: int) -> str:
    """``text`` in at most ``room`` terminal cells, an ellipsis where cut."""
    from rich.cells import cell_len, set_cell_size

    if cell_len(text) <= room:
        return text
    return set_cell_size(text, room - 1) + "…" if room > 0 else ""


def _print_lines(title: str, header: list[str], rows: list[list[str]], width: int) -> None:
    """``rows`` under ``title`` a line each, the columns padded to their widest cell and the
    last one cut to the terminal's ``width`` (an ellipsis where cut), never wrapped. The other
    columns are never cut: a name stays whole, so only names too long for the width overflow it."""
    from rich.cells import cell_len, set_cell_size

    widths = [max(cell_len(cell) for cell in column) for column in zip(header, *rows, strict=True)][:-1]
    room = max(0, width - sum(widths) - 2 * len(widths))
    print(title)
    for i, row in enumerate([header, *rows]):
        cells = [set_cell_size(cell, w) for cell, w in zip(row[:-1], widths, strict=True)]
        print("  ".join([*cells, _cut(row[-1], room)]).rstrip())
        if i == 0:
            print("-" * min(width, sum(widths) + 2 * len(widths) + room))
    print()


def cmd_policies(args: argparse.Namespace) -> int:
    import shutil

    registry = get_registry()
    sources = sorted({r.plugin for r in registry.policies.values()})
    source = BUILTIN_SOURCE[1] if args.source == BUILTIN_SOURCE[0] else args.source
    if source is not None and source not in sources:
        raise CommandError(f"--source {args.source!r}: no policy comes from it; sources: "
                           f"{', '.join([BUILTIN_SOURCE[0], *sources])} ({BUILTIN_SOURCE[0]} = {BUILTIN_SOURCE[1]})")
    filtered = source is not None or args.mode is not None or args.needs is not None
    # One line a policy, its summary cut to the terminal: the whole text is `kvpolicy show NAME`'s.
    rows: list[list[str]] = []
    entries: list[dict[str, Any]] = []  # for --json
    for name, registered in sorted(registry.policies.items()):
        if source is not None and registered.plugin != source:
            continue
        try:
            policy = load_policy(name)
        except (PolicyError, UnknownStageError) as exc:
            first = exc.problems[0] if isinstance(exc, PolicyError) and exc.problems else str(exc)
            if args.mode is not None or args.needs is not None:  # what it is cannot be known: said, not hidden
                print(f"kvpolicy: warning: policy {name!r} is invalid, left out of the filtered list: {first}",
                      file=sys.stderr)
                continue
            rows.append([name, registered.plugin, "-", "-", f"invalid: {first}"])
            entries.append({"name": name, "source": registered.plugin, "invalid": first})
            continue
        if args.mode is not None and policy.mode != args.mode:
            continue
        needs = [need for need, (_, needed) in NEEDS.items() if needed(policy)]
        if args.needs is not None and args.needs not in needs:
            continue
        summary = policy_summary(policy.config)
        rows.append([name, registered.plugin, policy.mode, str(policy.budget), summary])
        entries.append({"name": name, "source": registered.plugin, "mode": policy.mode, "budget": policy.budget,
                        "needs": needs, "summary": summary, "description": policy.config.description,
                        "reference": policy.config.reference})
    if args.json:
        sys.stdout.write(json.dumps(entries, indent=2) + "\n")
        return 0
    width = shutil.get_terminal_size((100, 24)).columns  # COLUMNS when set
    _print_lines("Policies (the whole text: kvpolicy show NAME)", ["name", "source", "mode", "budget", "summary"],
                 rows, width)
    if filtered:
        return 0  # a filtered list is of policies only
    for kind in STAGE_KINDS:
        stages = [[type_name, r.plugin, first_sentence(r.obj.__doc__)]
                  for type_name, r in sorted(registry.stages[kind].items())]
        _print_lines(f"{kind.capitalize()}s", ["type", "source", "description"], stages, width)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.overrides)
    if args.budget is not None:
        overrides["budget"] = args.budget
    policy = load_policy(_policy_source(args.policy), **overrides)
    sys.stdout.write(policy.to_yaml())
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.files:
        try:
            load_policy(_policy_source(name))
        except PolicyError as exc:
            failed += 1
            for problem in exc.problems:
                print(locate_problem(name, problem))
        except (UnknownStageError, CommandError, OSError) as exc:
            failed += 1
            print(f"{name}: {exc}")
        else:
            print(f"{name}: OK")
    if failed:
        print(f"{failed} of {len(args.files)} policy file(s) invalid", file=sys.stderr)
        return EXIT_INVALID
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    text = json.dumps(policy_json_schema(), indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        replace_file(check_output(args.output), text.encode("utf-8"))  # never a truncated schema
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


PROFILE_EPILOG = """\
examples:
  kvpolicy profile -o smollm2.yaml                          # spread of attention, bundled model
  kvpolicy profile --method passkey --tokens 2048 -o retrieval.yaml
  kvpolicy profile --model path/to/model --text calibration.txt --device cuda -o profile.json
"""


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="compute a head profile (a weight per layer and KV head) of a model from a calibration text",
        description="Run a model once over a calibration text and write a head profile: a weight for every\n"
        "(layer, KV head), for per-head budget allocation.\n"
        "  concentration: the normalised entropy of each head's attention (spread heads weigh more)\n"
        "  passkey: the attention mass a head puts on a planted passkey when asked for it\n"
        "           (retrieval heads weigh more)\n"
        "The definitions: docs/allocation.md, 'Head profiles'.",
        epilog=PROFILE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bundled", help="'bundled' (default: SmolLM2-135M GGUF), a model folder, "
                                                      "a .gguf file or a Hugging Face id (org/name)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", metavar="FILE", help="a UTF-8 calibration text file")
    text.add_argument("--calibration", choices=["builtin"], help="builtin (default): reasoning-gym's public-domain "
                                                                 "prose, in_the_year_2889.txt")
    p.add_argument("--method", choices=["concentration", "passkey"], default="concentration",
                   help="what the weights measure (default: concentration)")
    p.add_argument("--tokens", type=int, default=1024, help="calibration tokens fed to the model (default: 1024)")
    p.add_argument("--window", type=int, help="concentration: how many final queries are scored (default: 32)")
    p.add_argument("--depth", type=float, help="passkey: where the key is planted, a fraction of the text "
                                               "(default: 0.5)")
    p.add_argument("--seed", type=int, default=0, help="passkey: seed of the key's digits (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="float32",
                   help="the model's dtype (default: float32); the weights are computed in float64")
    p.add_argument("--output", "-o", type=Path, required=True, metavar="FILE",
                   help="the profile file to write: .yaml, .yml or .json")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from .profiles import compute_profile, concentration_calibration, passkey_calibration

    if args.output.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise CommandError(f"--output must end in .yaml, .yml or .json, got {str(args.output)!r}")
    check_output(args.output)  # found out before the model runs, not after
    if args.method == "passkey" and args.window is not None:
        raise CommandError("--window is for the concentration method (passkey scores the answer's positions)")
    if args.method == "concentration" and args.depth is not None:
        raise CommandError("--depth is for the passkey method")
    try:  # the model loading and the default text are the evaluation harness's
        from .eval.config import EvalError
        from .eval.data import read_text
        from .eval.models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model
    except ImportError as exc:
        raise CommandError(f"computing a profile needs the evaluation harness, to load the model "
                           f"({type(exc).__name__}: {exc}); install it with: pip install 'kvpolicy[eval]'") from None
    try:
        source = resolve_model(args.model)
        device = resolve_device(args.device)
        text, text_name = read_text(args.text)
        tokenizer = load_tokenizer(source)
        if args.method == "concentration":
            window = 32 if args.window is None else args.window
            calibration = concentration_calibration(tokenizer, text, args.tokens, window)
        else:
            depth = 0.5 if args.depth is None else args.depth
            calibration = passkey_calibration(tokenizer, text, args.tokens, seed=args.seed, depth=depth)
        print(f"kvpolicy profile: {args.method} of {source.name} on {calibration.description} of {text_name}",
              file=sys.stderr)
        model = load_model(source, resolve_dtype(args.dtype, device), device)
        profile = compute_profile(model, calibration.input_ids, args.method, window=calibration.window,
                                  key_span=calibration.key_span, model_name=source.name)
    except (EvalError, ValueError) as exc:
        if isinstance(exc, PolicyError):
            raise
        raise CommandError(str(exc)) from None
    _save(profile, args.output)
    _print_profile_summary(profile.head_weights(), args.method)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


CALIBRATE_EPILOG = """\
examples:
  kvpolicy calibrate -o smollm2.safetensors                 # bundled model, bundled prose
  kvpolicy calibrate --model path/to/model --text traces.txt --tokens 32768 --device cuda -o q.safetensors
  kvpolicy calibrate --model path/to/model --add-fingerprint old.safetensors -o q.safetensors
then: {type: triattention, calibration: q.safetensors} in a policy file
"""


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure a query calibration of a model (TriAttention's per-head query statistics)",
        description="Run a model once over a calibration text and write, per layer and query head, the mean\n"
        "and mean modulus of its pre-RoPE queries in each RoPE frequency pair: the statistics the\n"
        "triattention scorer reads (docs/policies/triattention.md).",
        epilog=CALIBRATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bundled", help="'bundled' (default: SmolLM2-135M GGUF), a model folder, "
                                                      "a .gguf file or a Hugging Face id (org/name)")
    p.add_argument("--text", metavar="FILE", help="a UTF-8 calibration text file (default: reasoning-gym's "
                                                  "public-domain prose, in_the_year_2889.txt)")
    p.add_argument("--tokens", type=int, help="calibration tokens fed to the model (default: 4096)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="float32",
                   help="the model's dtype (default: float32); the statistics are computed in float64")
    p.add_argument("--add-fingerprint", type=Path, metavar="FILE",
                   help="measure nothing: write FILE, a calibration measured on --model before kvpolicy recorded "
                        "model fingerprints, with the model's fingerprint added (its statistics unchanged); "
                        "refused for a file that records another model's fingerprint")
    p.add_argument("--output", "--out", "-o", type=Path, required=True, metavar="FILE",
                   help="the calibration file to write (.safetensors)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.output.suffix.lower() != ".safetensors":
        raise CommandError(f"--output must end in .safetensors, got {str(args.output)!r}")
    check_output(args.output)  # found out before the model runs, not after
    if args.add_fingerprint is not None and (args.text is not None or args.tokens is not None):
        raise CommandError("--text and --tokens are for measuring; --add-fingerprint measures nothing: give one or "
                           "the other")
    if args.tokens is None:
        args.tokens = 4096
    if args.tokens < 2:
        raise CommandError(f"--tokens must be at least 2, got {args.tokens}")
    try:
        from .calibrate import measure_query_calibration
        from .eval.config import EvalError
        from .eval.data import read_text
        from .eval.models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model
    except ImportError as exc:
        raise CommandError(f"calibrating needs the evaluation harness, to load the model "
                           f"({type(exc).__name__}: {exc}); install it with: pip install 'kvpolicy[eval]'") from None
    try:
        source = resolve_model(args.model)
        device = resolve_device(args.device)
        if args.add_fingerprint is not None:  # no text: nothing is measured
            return _add_fingerprint(args, source, lambda: load_model(source, resolve_dtype(args.dtype, device), device))
        text, text_name = read_text(args.text)
        ids = load_tokenizer(source)(text, add_special_tokens=False)["input_ids"]
        if len(ids) < args.tokens:
            raise CommandError(f"--tokens: the text has {len(ids)} tokens, fewer than the {args.tokens} asked for")
        print(f"kvpolicy calibrate: {source.name} on {args.tokens} tokens of {text_name}", file=sys.stderr)
        model = load_model(source, resolve_dtype(args.dtype, device), device)
        calibration = measure_query_calibration(model, ids[: args.tokens], text=text_name)
    except (EvalError, ValueError) as exc:
        if isinstance(exc, PolicyError):
            raise
        raise CommandError(str(exc)) from None
    _save(calibration, args.output)
    shape = calibration.shape
    print(f"wrote {args.output}: {calibration.model}, {shape['num_layers']} layers x {shape['num_attention_heads']} "
          f"query heads x {shape['head_dim'] // 2} frequency pairs", file=sys.stderr)
    return 0


def _add_fingerprint(args: argparse.Namespace, source: Any, load_model: Callable[[], Any]) -> int:
    """``kvpolicy calibrate --add-fingerprint FILE``: FILE with the fingerprint of the model
    ``load_model`` loads (FILE is read first: a missing or broken one costs no model load)."""
    from .hf.facts import model_facts
    from .stages.triattention import CalibrationWarning, QueryCalibration

    with warnings.catch_warnings():  # the file lacks the fingerprint: that is why it is given
        warnings.simplefilter("ignore", CalibrationWarning)
        old = QueryCalibration.load(args.add_fingerprint)
    stamped = old.with_fingerprint(model_facts(load_model()))
    _save(stamped, args.output)
    if stamped is old:
        print(f"wrote {args.output}: nothing added, {args.add_fingerprint} already records the fingerprint of "
              f"{source.name}", file=sys.stderr)
    else:
        print(f"wrote {args.output}: {args.add_fingerprint} with the fingerprint of {source.name}", file=sys.stderr)
    return 0


def _save(data: Any, path: Path) -> None:
    """``data.save(path)``; a write that fails all the same (a full disk) is a ``CommandError``
    naming the file. The saves replace the file whole, so nothing truncated is left."""
    try:
        data.save(path)
    except OSError as exc:
        raise CommandError(f"--output: cannot write {path}: {exc.strerror or exc}") from None


def _print_profile_summary(weights: Any, method: str) -> None:
    """Per layer: the smallest, mean and largest head weight (``weights`` ``[L, Hkv]``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{method} weights", title_justify="left",
                  caption=f"{weights.shape[0]} layers x {weights.shape[1]} KV heads", caption_justify="left")
    for name in ("layer", "min", "mean", "max"):
        table.add_column(name, justify="right", no_wrap=True)
    for layer, row in enumerate(weights):
        table.add_row(str(layer), *(f"{float(v):.4f}" for v in (row.min(), row.mean(), row.max())))
    table.add_row("all", *(f"{float(v):.4f}" for v in (weights.min(), weights.mean(), weights.max())), style="bold")
    Console().print(table)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """The ``eval`` subcommand, from the evaluation harness when it is importable.

    ``kvpolicy.eval.cli.add_eval_parser(subparsers)`` adds the ``eval`` parser and sets its
    ``func`` default to a handler ``func(args) -> int | None``; without it, ``eval`` still exists
    and explains what is missing.
    """
    try:
        from .eval.cli import add_eval_parser
    except ImportError as exc:
        problem = exc  # the name ``exc`` is cleared when the except block ends
        p = sub.add_parser("eval", help="evaluate policies (needs the evaluation harness)")
        p.set_defaults(func=lambda args: _eval_missing(problem), accepts_extra=True)
        return
    add_eval_parser(sub)


def _eval_missing(exc: ImportError) -> int:
    missing = getattr(exc, "name", None) or ""
    hint = ""
    if missing and not missing.startswith("kvpolicy"):
        hint = f"; install its dependencies with: pip install 'kvpolicy[eval]' (missing {missing!r})"
    raise CommandError(f"the evaluation harness is not installed ({type(exc).__name__}: {exc}){hint}")


# -- helpers --------------------------------------------------------------------------------------
def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["budget=512", "recent=budget - 4"]`` -> ``{"budget": 512, "recent": "budget - 4"}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            # Policy-file rules (no aliases, bounded nesting); what is not YAML stays a string.
            value = load_yaml(raw)[1] if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out[key.strip()] = value
    return out


def locate_problem(filename: str, problem: str) -> str:
    """``"line 3: schedule.budget: ..."`` -> ``"FILE:3: schedule.budget: ..."`` (editor style)."""
    m = _LINE_PREFIX.match(problem)
    if m is None:
        return f"{filename}: {problem}"
    where = m.group(1) if m.group(2) is None else f"{m.group(1)}:{m.group(2)}"
    return f"{filename}:{where}: {problem[m.end() :]}"


def _policy_source(name: str) -> str | Path:
    """A registered name stays a name; anything that looks like a file becomes a ``Path``."""
    registry: Registry = get_registry()
    if name in registry.policies:
        return name
    path = Path(name)
    try:
        is_file = path.is_file()
        looks_like_a_file = is_file or bool(path.suffix) or len(path.parts) > 1 or path.exists()
    except (OSError, ValueError) as exc:  # a name too long for the OS, a NUL byte
        raise CommandError(f"no such policy file: {name} ({exc})") from None
    if looks_like_a_file:
        if not is_file:
            raise CommandError(f"{name} is a directory, not a policy file" if path.is_dir()
                               else f"no such policy file: {name}")
        return path
    if "\n" in name or ":" in name:  # load_policy would read it as YAML text: not on the command line
        known = ", ".join(sorted(registry.policies))
        raise CommandError(f"unknown policy {name!r}; registered policies: {known}")
    return name  # load_policy reports the unknown name with the registered ones


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _error(message: str) -> None:
    print(f"kvpolicy: error: {' '.join(message.split())}", file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, PluginLoadWarning):
        print(f"kvpolicy: warning: {message}", file=sys.stderr)
    else:
        print(warnings.formatwarning(message, category, filename, lineno, line), file=sys.stderr, end="")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
