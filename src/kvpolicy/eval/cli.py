"""``kvpolicy eval``: compare policies and budgets on one model (also ``python -m kvpolicy.eval``).

Building the parser imports nothing heavy; torch and transformers load when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EPILOG = """\
examples:
  kvpolicy eval                                   # VaSE's paper set of 11 built-ins at budgets 96 and 128
  kvpolicy eval --policies snapkv vase-attnv --budgets 128 256 512 --metrics perplexity passkey
  kvpolicy eval --model path/to/model_or.gguf --set fidelity.new_tokens=128
  kvpolicy eval --config runs/20261101-120000/config.yaml   # repeat a saved run
  kvpolicy eval --resume runs/20261101-120000               # finish an interrupted run
  kvpolicy eval --report runs/20261101-120000               # its tables and plots from the pairs done so far
  kvpolicy eval --config docs/examples/ranking.yaml         # rank every built-in policy
  kvpolicy eval --lm-tasks gsm8k --limit 50 --samples 4 --temperature 0.6   # the reasoning protocol
  kvpolicy eval --model Qwen/Qwen3-4B --device cuda --dtype bfloat16 --lm-tasks aime25 --samples 8
metrics: perplexity, fidelity, passkey, accuracy, reconstruction, speed, lm
"""


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to a ``kvpolicy`` parser; its handler is ``args.func``."""
    p = subparsers.add_parser(
        "eval",
        help="compare policies and budgets on one model (perplexity, fidelity, passkey, ...)",
        description="Compare eviction policies and budgets on one model against the full cache.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run_command)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="a saved run configuration (config.yaml) to start from")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run in RUN_DIR, as configured "
                                                       "(no other flag but --no-progress)")
    p.add_argument("--report", metavar="RUN_DIR", help="run nothing: write RUN_DIR's metrics.json, tables and plots "
                                                       "from the pairs it has finished")
    p.add_argument("--model", help="'bundled' (default: SmolLM2-135M GGUF), a model folder, a .gguf file or a "
                                   "Hugging Face id (org/name; downloaded when online)")
    p.add_argument("--policies", nargs="+", metavar="POLICY", help="policy names or YAML files (default: VaSE's paper set of 11 built-ins; `builtin`: every policy kvpolicy ships; `all`: and every installed plugin's)")
    p.add_argument("--budgets", nargs="+", type=int, metavar="N", help="budgets in slots (default: 96 128)")
    p.add_argument("--metrics", nargs="+", metavar="METRIC", help="metrics to compute (default: all but accuracy)")
    p.add_argument("--tasks", nargs="+", metavar="TASK", help="reasoning-gym tasks for the accuracy metric")
    p.add_argument("--text", metavar="FILE", help="long text for perplexity, reconstruction and speed")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--device-map", help="'auto': spread the model over every GPU (transformers device_map)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any configuration field, e.g. perplexity.tokens=1024 or passkey.context=[512,1024]",
    )
    lm = p.add_argument_group(
        "reasoning protocol (lm-evaluation-harness tasks, the 'lm' metric; each flag sets lm.<field>)")
    lm.add_argument("--lm-tasks", nargs="+", metavar="TASK",
                    help="lm-eval tasks (gsm8k, minerva_math500, aime25, gpqa_diamond_cot_zeroshot, ...) or task "
                         "YAML files; selects the lm metric unless --metrics is given")
    lm.add_argument("--limit", type=float, help="problems per task (a fraction if below 1): a quick look")
    lm.add_argument("--samples", type=int, metavar="N", help="samples per problem (pass@1 is their mean)")
    lm.add_argument("--pass-k", type=int, nargs="+", metavar="K", help="pass@k to report (default: 1 and N)")
    lm.add_argument("--temperature", type=float, help="sampling temperature (default: the task's; 0 is greedy)")
    lm.add_argument("--top-p", type=float)
    lm.add_argument("--top-k", type=int)
    lm.add_argument("--max-new-tokens", type=int, metavar="N", help="the thinking budget (default: the task's)")
    lm.add_argument("--batch-size", type=int, metavar="B", help="rows decoded together (default 1)")
    lm.add_argument("--no-chat-template", action="store_true", help="plain prompts (default: the chat template)")
    lm.add_argument("--thinking", choices=["on", "off"], help="enable_thinking for the chat template (Qwen3)")
    lm.add_argument("--include-path", metavar="DIR", help="a folder of extra lm-eval task YAML files")
    lm.add_argument("--progress-every", type=int, metavar="N", help="a progress line every N samples (default 10)")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<timestamp>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_config(args: argparse.Namespace):
    from .config import EvalConfig, apply_sets

    data = EvalConfig.load(args.config).model_dump() if args.config else {}
    saved_pairs = _pairs(data)
    flags = {
        "model": args.model,
        "policies": _split(args.policies),
        "budgets": args.budgets,
        "metrics": _split(args.metrics),
        "text": args.text,
        "seed": args.seed,
        "device": args.device,
        "device_map": args.device_map,
        "dtype": args.dtype,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    if args.tasks:
        data.setdefault("accuracy", {})
        data["accuracy"] = {**dict(data["accuracy"]), "tasks": _split(args.tasks)}
    lm = {
        "tasks": _split(args.lm_tasks),
        "limit": args.limit,
        "samples": args.samples,
        "ks": args.pass_k,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "chat_template": False if args.no_chat_template else None,
        "enable_thinking": None if args.thinking is None else args.thinking == "on",
        "include_path": args.include_path,
        "progress_every": args.progress_every,
    }
    lm = {k: v for k, v in lm.items() if v is not None}
    if lm:
        data["lm"] = {**dict(data.get("lm") or {}), **lm}
    if args.lm_tasks and args.metrics is None:
        data["metrics"] = ["lm"]
    data = apply_sets(data, args.sets)
    if _pairs(data) != saved_pairs:  # other pairs than the saved run's: resolved from names and files now
        data.pop("resolved_policies", None)
    return EvalConfig.build(data, "options")


def _pairs(data: dict) -> tuple:
    """What decides a configuration's (policy, budget) pairs."""
    return data.get("policies"), sorted(set(data.get("budgets") or []))


#: The flags a resumed run (or a report) takes: they change no figure, file or folder.
OUTPUT_ONLY = ("resume", "report", "no_progress")


def _run_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that would change a run (every one but ``OUTPUT_ONLY``), as typed."""
    skip = {*OUTPUT_ONLY, "command", "func"}
    given = [k for k, v in vars(args).items() if k not in skip and v is not None and v is not False and v != []]
    return ["--set" if k == "sets" else "--" + k.replace("_", "-") for k in given]


def _split(items: Sequence[str] | None) -> list[str] | None:
    """Accept both ``a b`` and ``a,b``."""
    if items is None:
        return None
    return [x for item in items for x in item.split(",") if x]


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .config import EvalError
    from .report import build_table, markdown_table
    from .runner import RunInterrupted, run_eval

    err = Console(stderr=True)
    try:
        if args.report:
            if args.resume:
                raise EvalError("--report and --resume both name a run folder: give one")
            args.resume = args.report
        if args.resume:
            given = _run_flags(args)
            if given:
                flag = "--report" if args.report else "--resume"
                raise EvalError(f"{flag} continues a run as configured in its config.yaml (and in its folder); "
                                f"drop {', '.join(given)}")
            config = None
        else:
            config = build_config(args)
        result = run_eval(config, args.out, resume=args.resume, console=err, progress=not args.no_progress,
                          report_only=bool(args.report))
    except EvalError as exc:
        err.print(f"[red]kvpolicy eval: error:[/red] {exc}", highlight=False)
        return EXIT_USAGE
    except RunInterrupted as exc:
        err.print(f"[yellow]interrupted[/yellow]: finished pairs are saved; continue with "
                  f"kvpolicy eval --resume {exc.folder}")
        return EXIT_INTERRUPTED
    table_md = markdown_table(result.plan.columns, result.rows)
    (result.folder / "table.md").write_text(table_md, encoding="utf-8")
    out = Console() if sys.stdout.isatty() else Console(width=200)
    out.print(build_table(result.plan.columns, result.rows, title=f"kvpolicy eval: {result.plan.source.name}"))
    err.print(f"figures: {result.folder / 'metrics.json'}  (table: {result.folder / 'table.md'}, "
              f"examples: {result.folder / 'predictions.jsonl'}, config: {result.folder / 'config.yaml'})")
    err.print(f"plots:   {result.folder / 'plots'}/ ({', '.join(p.name for p in result.plots)})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy.eval", description=EPILOG.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    add_eval_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "eval":
        argv = ["eval", *argv]
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
