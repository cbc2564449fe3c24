"""``dart-ray batch``: offline generation over a parquet/JSONL file with a pool of engine actors.

    dart-ray batch --input prompts.parquet --output out/ --concurrency 2 --batch-size 32
    python -m batch.cli --input prompts.jsonl --output out/ --method none --max-new-tokens 64

Rerunning with the same ``--output`` after a crash or kill resumes: only ids not yet committed
are generated, and the output ends up with every input id exactly once. Exit status: 0 when the
output is complete (error rows count as complete), 1 when ids are missing or duplicated or the
engine kept failing, 2 on bad arguments or input (or an output directory that is not this job's).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from batch.generator import EngineFailure
from batch.job import BatchJobConfig, run_batch_job
from batch.store import CorruptPartError, OutputBusyError
from batch.watchdog import PipelineStalled
from dart_ray import EngineConfig, ModelLoadError, SamplingParams, check_model, joins_cluster
from dart_ray.config import add_engine_args


def add_batch_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``dart-ray batch`` (usable as a subparser of the main CLI)."""
    io = p.add_argument_group("input/output")
    io.add_argument("--input", required=True,
                    help=".parquet, .jsonl/.json (JSON Lines), or a directory of them")
    io.add_argument("--output", required=True, help="output directory (rerun with it to resume)")
    io.add_argument("--prompt-column", default="prompt")
    io.add_argument("--id-column", default="id",
                    help="unique row id; if the input lacks it, ids are row numbers in file order")
    io.add_argument("--force", action="store_true",
                    help="resume into an output written by a different job (other settings, "
                         "input files or prompts): committed rows are kept as they are")
    g = p.add_argument_group("generation")
    g.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help="row seed = seed + hash(id)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    e = add_engine_args(p, title="engine (as in `dart-ray generate`)", method="auto", help={
        "num_threads": "torch threads per actor (default: floor of --num-cpus-per-actor)",
        "max_batch_size": "rows an engine decodes together (default 8; 1 with --no-adaptive: "
                          "bf16 greedy outputs equal `dart-ray generate --no-adaptive` bit for "
                          "bit; fp32 equals them at any size)"})
    e.add_argument("--profile", default=None, help="decoding profile (name or YAML path)")
    r = p.add_argument_group("ray")
    r.add_argument("--concurrency", type=int, default=1, help="engine actors")
    r.add_argument("--batch-size", type=int, default=32, help="rows per actor call and per part")
    r.add_argument("--num-cpus-per-actor", type=float, default=None,
                   help="default: (cluster CPUs - 1) / concurrency")
    r.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS if set, else a new local Ray)")
    r.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray instance")
    r.add_argument("--ray-temp-dir", default=None)
    r.add_argument("--stall-timeout", type=float, default=900.0,
                   help="seconds without a committed batch before the pipeline is stopped and "
                        "resumed from its committed parts (0 = never); set above the slowest batch")
    r.add_argument("--max-resumes", type=int, default=2, help="automatic resumes after a stall")
    r.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(a: argparse.Namespace) -> BatchJobConfig:
    engine = EngineConfig.from_args(a)
    sampling = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                              top_p=a.top_p, top_k=a.top_k, ignore_eos=a.ignore_eos,
                              stop=tuple(a.stop or ()))
    return BatchJobConfig(input=a.input, output=a.output, prompt_column=a.prompt_column,
                          id_column=a.id_column, chat=a.chat, engine=engine, sampling=sampling,
                          seed=a.seed, profile=a.profile, concurrency=a.concurrency,
                          batch_size=a.batch_size, num_cpus_per_actor=a.num_cpus_per_actor,
                          force=a.force, progress=not a.no_progress,
                          stall_timeout_s=a.stall_timeout or None, max_resumes=a.max_resumes)


def ray_init_kwargs(a: argparse.Namespace) -> dict:
    kw: dict = {"include_dashboard": False}
    if a.address:
        kw["address"] = a.address
    else:
        if a.num_cpus is not None:
            kw["num_cpus"] = a.num_cpus
        if a.ray_temp_dir:
            kw["_temp_dir"] = os.path.abspath(a.ray_temp_dir)
    return kw


def batch_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dart-ray batch", description=__doc__.split("\n")[0])
    add_batch_args(parser)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        parser.error(str(e))
    try:            # the model, before Ray and the actors start (a cluster's nodes may hold it)
        check_model(cfg.engine.model)
    except ModelLoadError as e:
        if not joins_cluster(a.address):
            print(f"dart-ray batch: error: {e}", file=sys.stderr)
            return 2
        logging.getLogger(__name__).warning("model %r is not readable here (%s); the actors "
                                            "load it on their nodes", cfg.engine.model, e)
    try:
        summary = run_batch_job(cfg, ray_init=ray_init_kwargs(a))
    except (ValueError, KeyError, FileNotFoundError, NotADirectoryError, OutputBusyError,
            CorruptPartError, PipelineStalled) as e:
        print(f"dart-ray batch: error: {e}", file=sys.stderr)
        return 2
    except EngineFailure as e:  # the output is incomplete, as with missing ids
        print(f"dart-ray batch: error: {e}", file=sys.stderr)
        return 1
    finally:
        _shutdown_ray()
    print(summary.format())
    return 0 if summary.ok else 1


def _shutdown_ray() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(batch_cli())
