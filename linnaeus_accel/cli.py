"""``linnaeus-accel`` command line (also ``python -m linnaeus_accel``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence, Sized
from typing import NoReturn

from . import __version__
from .cli_arguments import OPTS_FLAG, parse_arguments
from .config import Config, ConfigError, load_config, output_dir_problem
from .process.failures import RunFailed
from .process.launcher import REPORT_GRACE_S, follow_launcher, report_refusal
from .schedule import ResolvedPlan, batches_per_process, resolve_plan

EXIT_FAILED = 1  # the run stopped (summary.json: status failed): non-finite loss, disk full, a hung process
EXIT_CONFIG_ERROR = 2  # config, arguments or output directory refused: nothing was trained
EXIT_INTERRUPTED = 130  # Ctrl-C: the step finished and was checkpointed (summary.json: status interrupted); the same command resumes
EXIT_NOT_SYNCED = 3  # trained to the end (or preempted), but ENV.OUTPUT.BUCKET lacks checkpoints the run keeps: the same command again uploads them


class _Parser(argparse.ArgumentParser):
    """argparse's, but an argument error is said once under a launcher, as a config error is."""

    def error(self, message: str) -> NoReturn:
        report_refusal(f"{self.prog}: error: {message}", usage=self.format_usage())
        self.exit(EXIT_CONFIG_ERROR)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cfg", required=True, metavar="FILE", help="YAML config (e.g. configs/default.yaml)"
    )
    parser.add_argument(
        OPTS_FLAG,
        nargs="+",
        default=[],
        metavar="KEY VALUE",
        help="overrides as dotted KEY VALUE pairs, each VALUE read as YAML as after KEY: in a file (null too, "
        "and values starting with '-'), e.g. --opts TRAIN.EPOCHS 20 LR_SCHEDULER.NAME wsd",
    )


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, Mapping[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's."""
    parser = _Parser(prog="linnaeus-accel", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan",
        help="resolve the whole schedule without training",
        description="Resolve every schedule parameter into global optimizer steps and show the plan.",
    )
    _add_config_args(plan)
    plan.add_argument(
        "--world-size", type=int, default=1, metavar="N", help="number of processes (default 1)"
    )
    plan.add_argument(
        "--dataset-size",
        type=int,
        default=None,
        metavar="N",
        help="training samples; default: build the configured training dataset and count them",
    )
    plan.add_argument(
        "--tokens-per-sample",
        type=int,
        default=None,
        metavar="N",
        help="target tokens in every training sample (packed fixed-length sequences); lets "
        "--dataset-size resolve TRAIN.TARGET_TOKENS without building the dataset",
    )
    plan.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        default=None,
        help="say what resuming from this checkpoint changes (default: the newest one in the output directory)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    plan.add_argument("--no-series", action="store_true", help="with --json: leave out the per-step series")
    plan.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="also draw the schedule (LR of every group, masking and mixup probabilities, epochs, "
        "validation and checkpoints) to FILE (.png, .svg or .pdf); needs the 'plot' extra (matplotlib)",
    )
    train = commands.add_parser(
        "train",
        help="train as the config says (also under `accelerate launch -m linnaeus_accel train`)",
        description="Train the configured model on the configured dataset; results go to "
        "<ENV.OUTPUT.BASE_DIR>/<EXPERIMENT.NAME>.",
    )
    _add_config_args(train)
    train.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        default=None,
        help="resume from this checkpoint directory (default with TRAIN.AUTO_RESUME: the newest complete "
        "one in the output directory)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh, deleting what an earlier run wrote to the output directory (checkpoints included)",
    )
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though the config changed in a way that rewrites the steps already trained "
        "(data, seed, model, loss, a schedule's past values); each change is listed",
    )
    train.add_argument(
        "--unsafe-load-pickles",
        action="store_true",
        help="resume a checkpoint written by an earlier linnaeus-accel whose registered state (an EMA, a "
        "callback's tensors) is a pickle: loading it runs any code its writer put in it, so only for "
        "checkpoints nobody else could write; refused without this flag",
    )
    evaluate = commands.add_parser(
        "evaluate",
        help="run the configured validation passes on a checkpoint or a run's final weights "
        "(also under `accelerate launch -m linnaeus_accel evaluate`)",
        description="Run the validation passes the config schedules at the end of training on the weights "
        "of a committed checkpoint or of a run's final/ directory, print one line per pass and write the "
        "metrics as JSON. Data, model and task come from the config (use the run's own); nothing in the "
        "run directory changes but the result file.",
    )
    _add_config_args(evaluate)
    evaluate.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="<run dir>/checkpoints/step_XXXXXXXX (committed: verified against its COMMITTED.json "
        "first) or <run dir>/final",
    )
    evaluate.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="where to write the metrics as JSON (default: <run dir>/eval/<checkpoint name>.json, "
        "e.g. eval/step_00000045.json or eval/final.json)",
    )
    tokenize = commands.add_parser(
        "tokenize",
        help="turn text corpora into a token file (.bin or .npy) and its sidecar, for training",
        description="Tokenize text files (.txt, .jsonl/.json, .parquet; .txt and .jsonl also gzipped) into "
        "a token file that training memory-maps, each document followed by an end-of-document token, and "
        "write the sidecar <PATH>.json beside it. Both appear whole or not at all.",
    )
    _add_tokenize_args(tokenize)
    return parser, commands.choices


def _add_tokenize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="a text file or a glob pattern (quoted; expanded sorted)"
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="PATH",
        help="the token file: PATH.bin (raw little-endian uint16, or uint32 for a vocabulary over 65536) "
        "or PATH.npy",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="FILE",
        default=None,
        help="a Hugging Face tokenizer.json (needs the 'data' extra); default: UTF-8 bytes "
        "(ids 0-255, end of document 256)",
    )
    parser.add_argument(
        "--eos-token",
        metavar="TOKEN",
        default=None,
        help="the tokenizer's end-of-document token; default: the first of <|endoftext|>, </s>, <eos>, "
        "<|end_of_text|> it has",
    )
    parser.add_argument(
        "--field",
        metavar="NAME",
        default="text",
        help="the text field of .jsonl/.json objects, or the column of .parquet files (default: text)",
    )
    parser.add_argument(
        "--text-unit",
        choices=("file", "line"),
        default="file",
        help="a .txt document: the whole file (default) or each non-empty line",
    )
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N", help="processes that tokenize in parallel (default 1)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing token file and its sidecar"
    )


def plan_for(
    config: Config, world_size: int, dataset_size: int | None, tokens_per_sample: int | None = None
) -> ResolvedPlan:
    """The resolved plan, building the training dataset when its size is not given (its
    ``tokens_per_sample``, if it declares one, is then read too unless given)."""
    arguments = []
    if dataset_size is not None and dataset_size < 0:
        arguments.append(("--dataset-size", f"must be >= 0 (got {dataset_size})"))
    if tokens_per_sample is not None and tokens_per_sample < 1:
        arguments.append(("--tokens-per-sample", f"must be >= 1 (got {tokens_per_sample})"))
    if world_size < 1:
        arguments.append(("--world-size", f"must be >= 1 (got {world_size})"))
    if arguments:
        raise ConfigError(arguments, source="arguments")
    sources: Sequence[object] = ()
    if dataset_size is None:
        from .data import build_dataset, dataset_problems

        dataset = build_dataset(config, "train")
        problems = dataset_problems(config.SCHEDULE, dataset)
        if problems:
            raise ConfigError(problems)
        if tokens_per_sample is None:
            tokens_per_sample = getattr(dataset, "tokens_per_sample", None)
        describe = getattr(dataset, "describe", None)
        sources = describe() if callable(describe) else ()
        if _epochs_of_unknown_length(dataset, world_size, config.DATA.NUM_WORKERS):
            return resolve_plan(config, None, world_size, None, tokens_per_sample)
        dataset_size = len(dataset)
    batches = batches_per_process(dataset_size, config.DATA.BATCH_SIZE, world_size, config.DATA.DROP_LAST)
    return resolve_plan(config, batches, world_size, dataset_size, tokens_per_sample, sources)


def _epochs_of_unknown_length(dataset: object, world_size: int, num_workers: int) -> bool:
    """A stream without ``__len__``, or one read shard by shard (whose passes end where its readers
    run out): what the trainer does with it, without building a loader."""
    from torch.utils.data import IterableDataset

    from .data.streams.streaming import shard_reading

    if not isinstance(dataset, IterableDataset):
        return False
    return not isinstance(dataset, Sized) or shard_reading(dataset, world_size, num_workers) is not None


def run_plan(args: argparse.Namespace) -> int:
    from .schedule.report.settings import report_settings
    from .schedule.report.summary import plan_json, summary_text

    if args.plot is not None:
        from .schedule.report.plot import matplotlib_problem

        if (missing := matplotlib_problem()) is not None:
            raise ConfigError([("--plot", missing)], source="arguments")
    config = load_config(args.cfg, args.opts)
    plan = plan_for(config, args.world_size, args.dataset_size, args.tokens_per_sample)
    settings = report_settings(config)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        # dumps, not dump: only the one-shot encoder is json's C one (4x faster on long event lists).
        sys.stdout.write(
            json.dumps(plan_json(settings, plan, with_series=not args.no_series), separators=(",", ":"))
        )
        sys.stdout.write("\n")
    else:
        sys.stdout.write(summary_text(settings, plan))
        if config.OPTIMIZER.NAME == "muon":
            sys.stdout.write("\n".join(muon_split_lines(config, plan.lr_curves[0].base_lr)) + "\n")
        from .checkpoint.resume.preview import resume_preview

        if preview := resume_preview(config.output_dir, plan, args.resume):
            sys.stdout.write("\nResume:   " + "\n          ".join(preview) + "\n")
    if args.plot is not None:
        from .schedule.report.plot import plot_for_cli

        # On stderr: with --json, stdout holds the JSON object alone.
        print(f"schedule plot written to {plot_for_cli(args.plot, settings, plan)}", file=sys.stderr)
    return 0


def muon_split_lines(config: Config, adamw_peak: float) -> list[str]:
    """The split of OPTIMIZER.NAME muon over the model, built on the meta device (no memory, no
    weights read; a registered builder that cannot build there is built for real): what each side
    trains and its peak LR (``adamw_peak``: LR group 0's; the Muon side's is it x MUON.LR / BASE_LR).
    A model registered only in the user's script, or data not on this machine (``plan
    --dataset-size``), leaves the split to train's start-up: the line says why."""
    import torch

    from .data import build_dataset
    from .models import build_model
    from .optim.muon import muon_split

    try:
        dataset = build_dataset(config, "train")  # the model may size itself by it (vocabulary, classes)
        try:
            with torch.device("meta"):
                model = build_model(config, dataset)
        except ConfigError:
            raise
        except Exception:  # an operation without a meta kernel: build it for real
            model = build_model(config, dataset)
    except ConfigError as exc:
        key, message = exc.problems[0]
        return [f"Split:    shown when train starts (the model cannot be built here: {key}: {message})"]
    ratio = config.OPTIMIZER.MUON.LR / config.LR_SCHEDULER.BASE_LR
    lines = muon_split(model, config.OPTIMIZER.MUON).lines(adamw_peak * ratio, adamw_peak)
    return ["Split:    " + lines[0], *("          " + line for line in lines[1:])]


def run_train(args: argparse.Namespace) -> int:
    from accelerate.utils import set_seed

    from .data import build_dataset, dataset_problems
    from .models import build_model
    from .training.trainer import Trainer

    config = load_config(args.cfg, args.opts)
    # Every process checks (the same answer on a shared file system), before anything is built.
    problem = output_dir_problem(config.output_dir)
    if problem is not None:
        raise ConfigError([problem])
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    problems = dataset_problems(config.SCHEDULE, train_data)
    if problems:
        raise ConfigError(problems)
    set_seed(config.EXPERIMENT.SEED)  # the same initial weights on every process and every run
    model = build_model(config, train_data)
    summary = Trainer(config, model, train_data, val_data).fit(
        resume_from=args.resume,
        overwrite=args.overwrite,
        allow_config_change=args.allow_config_change,
        unsafe_load_pickles=args.unsafe_load_pickles,
    )
    if _is_local_main() and not summary.get("already_finished"):  # that one was said by fit()
        last = summary["last_validation"]
        shown = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("val/"))
        tokens = f", {summary['tokens_seen']:,} tokens" if summary["tokens_seen"] else ""
        status = str(summary["status"]).replace("_", " ")
        where = f"{status} at step {summary['global_step']} (epoch {summary['epoch']}{tokens})"
        print(f"{where}: {shown}" if shown else where)
        if summary["status"] in ("preempted", "interrupted"):
            print("checkpointed: the same command resumes from there")
        print(f"outputs in {config.output_dir}")
    code = exit_status(summary)
    if code == EXIT_NOT_SYNCED and _is_local_main():
        unsynced = "; ".join(summary["remote_sync_errors"])
        print(f"linnaeus-accel: checkpoints not uploaded to the bucket: {unsynced}", file=sys.stderr)
    return code


def exit_status(summary: dict[str, object]) -> int:
    """0; EXIT_NOT_SYNCED when some checkpoints never reached the bucket (the run must not end
    looking clean while its off-machine copy is missing); EXIT_INTERRUPTED after Ctrl-C (a shell
    loop or ``&&`` stops there)."""
    if summary.get("remote_sync_errors"):
        return EXIT_NOT_SYNCED
    return EXIT_INTERRUPTED if summary.get("status") == "interrupted" else 0


def _is_local_main() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


def run_evaluate(args: argparse.Namespace) -> int:
    from .evaluate import evaluate

    evaluate(load_config(args.cfg, args.opts), args.checkpoint, args.out)
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    from .data.tokenize.command import tokenize_files

    sidecar = tokenize_files(
        args.inputs,
        args.output,
        tokenizer=args.tokenizer,
        eos_token=args.eos_token,
        field=args.field,
        text_unit=args.text_unit,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    print(
        f"{sidecar.num_documents:,} documents, {sidecar.num_tokens:,} tokens ({sidecar.dtype}) "
        f"written to {args.output}"
    )
    return 0


COMMANDS = {"plan": run_plan, "train": run_train, "evaluate": run_evaluate, "tokenize": run_tokenize}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(*_build_parsers(), sys.argv[1:] if argv is None else argv)
    follow_launcher()  # from the start: a launcher killed while this process imports torch
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        report_refusal(f"linnaeus-accel: {exc}")
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        # A second Ctrl-C (the first one checkpoints), or one before training started.
        print(
            "linnaeus-accel: stopped at once by Ctrl-C: the work since the last checkpoint is lost",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error of ours, and no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except RunFailed as failed:
        # Every process stops for the same reason; each says so once, naming itself when there are several.
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
        where = f"process {rank}: " if rank is not None and world != "1" else ""
        print(f"linnaeus-accel: {where}{failed}", file=sys.stderr, flush=True)
        if where:
            # Every process reached this together (the failure was agreed), but the launcher kills
            # the others the moment one exits: the one with more to clean up (the main process
            # removes the partial checkpoint) was killed before it printed (seen under load).
            time.sleep(REPORT_GRACE_S)
        return EXIT_FAILED


def console() -> None:
    """The command line's entry point (``linnaeus-accel``, ``python -m linnaeus_accel``)."""
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A launched process ends here, past the interpreter's shutdown: gloo's threads, kept alive
        # by the process group that DDP still references after end_training, were seen to abort it
        # there ("terminate called without an active exception", exit -6) after a clean run.
        # Everything of ours is written and closed by now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
