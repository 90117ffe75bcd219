"""Evaluate a search agent on a QA test parquet: the igpo_agent loop + tool server, scored like the training reward.

Run as ``python -m igpo.evaluate``; ``--help`` explains every flag.

With --recipe NAME (configs/recipe/NAME.yaml) the run also writes comparison.md: our scores in the paper's table
shape beside the published rows, with the recipe's corpus and its coverage caveat; the recipe's metric, turn limit
and top-k are the defaults, and settings.json records the recipe.

Writes into --out: results.md / results.csv (per data_source: n, EM, F1, judge, mean turns, mean tool calls, infra
errors), traces.jsonl (one line per row and run), accuracy_by_source.png, turns_hist.png and settings.json (model,
tools, judge, agent and sampling settings with runs and seed, data file + sha256, git commit, tool spend). Rerunning
with the same --out resumes: (row, run) pairs already in traces.jsonl are not redone; a different --runs is refused.
The logic lives in igpo/eval/ (evaluation.py runs the rows; settings, data, policy, tools, traces, tables and
plots have their own modules).

With --runs k (k > 1, needs --temperature > 0) each question is answered k times, run r of question q with its own
sampling seeds (from --seed, q and r), and every score (EM, F1, judge) also gets per data_source, ALL and AVG:

    avg@k  = mean over questions of the mean of its k runs' scores (= the mean over runs of each run's mean score)
    pass@k = mean over questions of the best of its k runs' scores: for EM and the judge (0/1) the share of questions
             answered correctly (EM = 1, judge yes) in at least one run; for F1 the mean best F1

so pass@k >= avg@k in every row. Runs without a score (no judge verdict) are left out of both.

Examples::

    # a local Hugging Face checkpoint and a local BM25 corpus (the script starts the tool server)
    python -m igpo.evaluate --data data/qa_test_7src.parquet --limit-per-source 4 \\
        --model-path .cache/tiny_model/<id> --corpus data/wiki_passages_1000.jsonl --out outputs/eval_tiny
    # a vLLM server (token ids in and out) and a running tool server, judged by an LLM (JUDGE_* in the environment)
    python -m igpo.evaluate --data data/qa_test_7src.parquet --endpoint http://127.0.0.1:8000/v1 \\
        --model qwen --tokenizer /models/qwen --tool-server http://127.0.0.1:8001 --judge --out outputs/eval_qwen
    # the CPU demo's held-out questions with its agent and validation settings, on a model SmolLM2 training left
    python -m igpo.evaluate --demo smollm2 --model-path <run>/model --out outputs/eval_smollm2_trained
    # avg@4 / pass@4: four sampled answers per question
    python -m igpo.evaluate --data data/qa_test_7src.parquet --endpoint http://127.0.0.1:8000/v1 \\
        --model qwen --tokenizer /models/qwen --tool-server http://127.0.0.1:8001 \\
        --runs 4 --temperature 0.7 --top-p 0.95 --out outputs/eval_qwen_k4

Exit status: 0 when every selected row is scored; 1 when some rows failed (rerun to redo them); 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from igpo.demo.world import TOPK as DEMO_TOPK
from igpo.eval.data import file_sha256, load_rows
from igpo.eval.demo_preset import STARTING_MODELS, demo_preset
from igpo.eval.evaluation import evaluate
from igpo.eval.plots import write_plots
from igpo.eval.policy import OpenAICompletionsServer, hf_server
from igpo.eval.settings import (
    EvalConfig, EvalInputError, check_resume, config_record, git_commit, write_settings,
)
from igpo.eval.tables import summarize, write_tables
from igpo.eval.tools import TopKTools, local_tool_server
from igpo.eval.traces import TraceStore
from igpo.integration.tool_spend import parse_prices, totals

# The checkout: the --demo preset reads its configs/ and the demo's files under .cache/.
REPO = Path(__file__).resolve().parents[1]

MAX_PRINTED_PROBLEMS = 50
OUTPUT_FILES = ("traces.jsonl", "results.md", "results.csv", "accuracy_by_source.png", "turns_hist.png",
                "settings.json", "comparison.md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = EvalConfig()
    # --demo NAME first: its preset supplies the defaults (and the data, model and corpus) of the full parser.
    demo_parser = argparse.ArgumentParser(add_help=False)
    demo_parser.add_argument("--demo", choices=sorted(STARTING_MODELS), default=None)
    demo_name = demo_parser.parse_known_args(argv)[0].demo
    p = argparse.ArgumentParser(prog="python -m igpo.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", choices=sorted(STARTING_MODELS), default=None,
                   help="evaluate as the CPU demo with demo.model=NAME validates: its held-out questions, corpus, "
                        "agent settings and validation sampling from configs/ (igpo/eval/demo_preset.py); the model "
                        "defaults to the demo's starting model, --model-path names a trained one; flags win")
    p.add_argument("--data", type=Path, required=demo_name is None, help="test parquet in the verl RL schema")
    p.add_argument("--out", type=Path, required=True, help="output directory (created; reused to resume)")
    p.add_argument("--limit-per-source", type=int, default=None, help="first N valid rows of each data_source")
    p.add_argument("--sources", default=None, help="comma-separated data_sources to evaluate (default: all)")
    p.add_argument("--allowed-sources", default=None,
                   help="comma-separated data_sources the file may contain; any other is reported as a bad row")
    p.add_argument("--skip-bad", action="store_true", help="evaluate the valid rows when some rows are bad")
    p.add_argument("--overwrite", action="store_true", help="delete this script's outputs in --out and start over")
    p.add_argument("--recipe", default=None,
                   help="a published setting (configs/recipe/NAME.yaml): its turn limit and top-k become the defaults, "
                        "and comparison.md sets our scores beside the paper's table")

    model = p.add_mutually_exclusive_group(required=demo_name is None)
    model.add_argument("--model-path", help="local Hugging Face checkpoint, generated with transformers")
    model.add_argument("--endpoint", help="OpenAI-compatible base URL serving token ids (vLLM), e.g. .../v1")
    p.add_argument("--model", help="model name on --endpoint")
    p.add_argument("--tokenizer", help="local tokenizer directory (default: --model-path; required with --endpoint)")
    p.add_argument("--api-key-env", default="EVAL_API_KEY",
                   help="environment variable holding the endpoint's API key (never logged or recorded)")

    tools = p.add_mutually_exclusive_group(required=demo_name is None)
    tools.add_argument("--tool-server", help="URL of a running tool_server")
    tools.add_argument("--corpus", type=Path, help="JSONL corpus: start a local BM25 tool server for this run")
    p.add_argument("--topk", type=int, default=None,
                   help=f"search results per query (default: the recipe's, else {d.top_k})")
    p.add_argument("--tool-timeout-s", type=float, default=d.tool_timeout_s,
                   help=f"seconds a tool call may take before it counts as failed (default {d.tool_timeout_s})")
    p.add_argument("--tool-price", action="append", default=None, metavar="UPSTREAM=USD_PER_1K",
                   help="price of 1,000 upstream calls, by upstream as the tool server's /stats names it (serper, "
                        "jina, summarizer, retriever, local; repeatable): settings.json's tool_spend estimates the cost")

    p.add_argument("--max-turns", type=int, default=None, help=f"default: the recipe's, else {d.max_turns}")
    p.add_argument("--max-tokens-per-turn", type=int, default=d.max_tokens_per_turn,
                   help=f"tokens the policy may generate in one turn (default {d.max_tokens_per_turn})")
    p.add_argument("--max-observation-tokens", type=int, default=d.max_observation_tokens,
                   help=f"a tool result is cut to this many tokens (default {d.max_observation_tokens})")
    p.add_argument("--system-prompt", default=None,
                   help="the agent's system prompt, as the policy was trained with (default: igpo.agent.protocol's); "
                        "the CPU demo's is algorithm.igpo.agent.system_prompt in configs/cpu_demo.yaml")
    p.add_argument("--tool-names", default=None, help="comma-separated tools the agent may call (default: search,visit)")
    p.add_argument("--prompt-length", type=int, default=d.prompt_length,
                   help=f"token budget of the question's prompt (default {d.prompt_length})")
    p.add_argument("--response-length", type=int, default=d.response_length,
                   help="token budget of the whole trajectory after the prompt: every turn and tool result "
                        f"(default {d.response_length})")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="0 = greedy (the default; needs --runs 1)")
    p.add_argument("--top-p", type=float, default=d.top_p, help=f"nucleus sampling's p (default {d.top_p})")
    p.add_argument("--runs", type=int, default=d.runs, metavar="K",
                   help="answers per question (default 1). K > 1 samples (needs --temperature > 0) and adds, per "
                        "score, avg@K (mean over questions of the mean of its K runs) and pass@K (mean over questions "
                        "of the best of its K runs: for EM / judge the share answered correctly, EM = 1 or judge yes, "
                        "in at least one run; for F1 the mean best F1); pass@K >= avg@K. A rerun into the same --out "
                        "needs the same K")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"base of the per-request sampling seeds (default {d.seed}): run r of question q repeats "
                        "where the backend honours a seed (the local HF model; vLLM)")
    p.add_argument("--chat-template-kwargs", default="{}", help='JSON, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="trajectories in flight at once")
    p.add_argument("--progress-every", type=int, default=d.progress_every, help="progress line every N rows")

    p.add_argument("--judge", action="store_true",
                   help="also score with the LLM judge (JUDGE_MODEL_NAME, JUDGE_API_BASE/API_BASE, JUDGE_API_KEY/"
                        "API_KEY from the environment)")
    p.add_argument("--judge-cache", type=Path, default=None,
                   help="SQLite verdict cache (default: <out>/judge_cache.sqlite)")
    if demo_name is None:
        args = p.parse_args(argv)
        args.demo_env = {}
        return args
    try:
        preset = demo_preset(demo_name, REPO, topk=DEMO_TOPK)
    except EvalInputError as err:
        p.error(str(err))
    p.set_defaults(**preset.defaults)
    args = p.parse_args(argv)
    args.data = args.data or preset.inputs["data"]
    if not (args.model_path or args.endpoint):
        args.model_path = preset.inputs["model_path"]
    if not (args.corpus or args.tool_server):
        args.corpus = preset.inputs["corpus"]
    args.demo_env = preset.env
    return args


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [s.strip() for s in value.split(",") if s.strip()]


def build_config(args: argparse.Namespace, recipe=None) -> EvalConfig:
    d = EvalConfig()
    try:
        template_kwargs = json.loads(args.chat_template_kwargs)
    except ValueError as err:
        raise EvalInputError(f"--chat-template-kwargs={args.chat_template_kwargs!r} is not JSON ({err}).") from None
    if not isinstance(template_kwargs, dict):
        raise EvalInputError(f"--chat-template-kwargs must be a JSON object, got {args.chat_template_kwargs!r}.")
    if args.endpoint and not args.model:
        raise EvalInputError("--endpoint needs --model (the model name the server serves).")
    if args.endpoint and not args.tokenizer:
        raise EvalInputError("--endpoint needs --tokenizer (a local directory with the served model's tokenizer).")
    return EvalConfig(
        max_turns=args.max_turns or (recipe.eval_max_turns if recipe else d.max_turns),
        max_tokens_per_turn=args.max_tokens_per_turn,
        max_observation_tokens=args.max_observation_tokens, prompt_length=args.prompt_length,
        response_length=args.response_length, temperature=args.temperature, top_p=args.top_p,
        top_k=args.topk or (recipe.tool_topk if recipe else d.top_k),
        concurrency=args.concurrency, tool_timeout_s=args.tool_timeout_s, judge=args.judge,
        progress_every=args.progress_every, chat_template_kwargs=template_kwargs, runs=args.runs, seed=args.seed,
        system_prompt=args.system_prompt, tool_names=tuple(_csv(args.tool_names)) if args.tool_names else None,
    )


def load_recipe_for(args: argparse.Namespace):
    """The --recipe's setting, or None; a judge-scored recipe needs --judge (its table would otherwise be empty)."""
    if args.recipe is None:
        return None
    from igpo.launch.recipes import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as err:
        raise EvalInputError(f"--recipe: {err}") from None
    if recipe.eval_metric == "judge" and not args.judge:
        raise EvalInputError(f"--recipe {recipe.name} is scored by an LLM judge, as its paper is; add --judge "
                             "(JUDGE_MODEL_NAME and JUDGE_API_BASE in the environment).")
    return recipe


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise EvalInputError(f"tokenizer directory {path!r} does not exist; pass a local checkpoint directory "
                             "(--model-path or --tokenizer). Nothing is downloaded.")
    return AutoTokenizer.from_pretrained(path)


def judge_settings_for(args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """(judge overrides for the reward function, judge description for settings.json); fails early if misconfigured."""
    if not args.judge:
        return None, None
    from igpo.reward import OutcomeRewardConfig, get_judge

    overrides = {"cache_path": str(args.judge_cache or args.out / "judge_cache.sqlite")}
    try:
        judge = get_judge(OutcomeRewardConfig(train_reward_type="llm", judge=overrides))
    except ValueError as err:
        raise EvalInputError(f"--judge: {err}") from None
    return overrides, judge.config.describe()


async def _health(url: str) -> dict:
    from tool_server.client import ToolClient

    async with ToolClient(url, timeout_s=10) as client:
        return await client.get_json("/health")


async def _stats(client) -> dict | None:
    try:
        return await client.get_json("/stats")
    except Exception:  # noqa: BLE001 - monitoring only; the numbers do not depend on it
        return None


async def run(args, config, rows, tokenizer, tool_url, store, judge_overrides) -> tuple:
    from tool_server.client import ToolClient

    client = ToolClient(tool_url, timeout_s=config.tool_timeout_s)
    before = await _stats(client)  # a shared tool server has served others: charge this run the difference only
    if args.model_path:
        server = hf_server(args.model_path, config)
    else:
        from igpo.agent.chat_frame import ChatFrame

        frame = ChatFrame.build(tokenizer, dict(config.chat_template_kwargs))
        server = OpenAICompletionsServer(args.endpoint, args.model, api_key=os.environ.get(args.api_key_env),
                                         stop_token_ids=[frame.eot_id])
    try:
        report = await evaluate(rows, tokenizer=tokenizer, server=server, tools=TopKTools(client, config.top_k),
                                config=config, store=store, judge_settings=judge_overrides)
        tool_stats = await _stats(client)
        spend = totals(tool_stats, parse_prices(args.tool_price), before=before)
    finally:
        await client.aclose()
        worker = getattr(server, "_worker", None)  # the HF server's batching task
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        if isinstance(server, OpenAICompletionsServer):
            await server.aclose()
    return report, tool_stats, spend


@contextlib.contextmanager
def environment_defaults(values: dict[str, str]):
    """Set the variables of ``values`` that the environment lacks, for the block only."""
    added = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    with environment_defaults(args.demo_env):  # the demo's rollout-server settings, unless exported
        return evaluate_args(args)


def evaluate_args(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        recipe = load_recipe_for(args)
        config = build_config(args, recipe)
        try:
            parse_prices(args.tool_price)  # a bad price fails here, not after the whole evaluation
        except ValueError as err:
            raise EvalInputError(str(err)) from None
        rows, problems = load_rows(args.data, limit_per_source=args.limit_per_source, sources=_csv(args.sources),
                                   allowed_sources=_csv(args.allowed_sources))
        if problems:
            print(f"{len(problems)} problem(s) in {args.data}:", file=sys.stderr)
            for problem in problems[:MAX_PRINTED_PROBLEMS]:
                print(f"  {problem}", file=sys.stderr)
            if len(problems) > MAX_PRINTED_PROBLEMS:
                print(f"  ... and {len(problems) - MAX_PRINTED_PROBLEMS} more", file=sys.stderr)
            if not args.skip_bad:
                raise EvalInputError("bad rows in the test set; fix them (python -m igpo.prepare_data --check shows "
                                     "the same schema) or pass --skip-bad to evaluate the valid rows only.")
        if not rows:
            raise EvalInputError(f"no row of {args.data} is selected; check --sources and --limit-per-source.")
        tokenizer = load_tokenizer(args.model_path or args.tokenizer)
        if args.model_path and not (Path(args.model_path) / "config.json").is_file():
            raise EvalInputError(f"--model-path {args.model_path!r} has no config.json; it must be a Hugging Face "
                                 "checkpoint directory.")
        args.out.mkdir(parents=True, exist_ok=True)  # the judge's verdict cache lives there
        judge_overrides, judge_description = judge_settings_for(args)
        agent, sampling = config_record(config, "hf" if args.model_path else "endpoint")
        if args.model_path:
            model = {"kind": "hf", "path": str(args.model_path)}
        else:
            model = {"kind": "endpoint", "url": args.endpoint, "model": args.model, "tokenizer": str(args.tokenizer)}
        if args.corpus:
            tools = {"backend": "local", "corpus": str(args.corpus), "top_k": config.top_k,
                     "corpus_sha256": file_sha256(args.corpus) if args.corpus.is_file() else None}
        else:
            tools = {"backend": None, "url": args.tool_server, "top_k": config.top_k}
        settings = {
            "model": model, "tools": tools, "judge": judge_description, "agent": agent, "sampling": sampling,
            "data_sha256": file_sha256(args.data),
            "data": {"path": str(args.data), "rows": len(rows), "bad_rows_skipped": len(problems),
                     "limit_per_source": args.limit_per_source, "sources": _csv(args.sources)},
            "recipe": recipe.settings_record() if recipe else None,
            "concurrency": config.concurrency, "git_commit": git_commit(),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if args.overwrite:
            for name in OUTPUT_FILES:
                (args.out / name).unlink(missing_ok=True)
        with contextlib.ExitStack() as stack:
            if args.corpus:
                tool_url = stack.enter_context(local_tool_server(args.corpus, config.top_k,
                                                                 args.out / "tool_server.log"))
            else:
                tool_url = args.tool_server
                try:
                    settings["tools"]["backend"] = asyncio.run(_health(tool_url)).get("backend")
                except Exception as err:  # noqa: BLE001 - any failure here means the URL is not a usable server
                    raise EvalInputError(f"--tool-server {tool_url!r} is not reachable ({type(err).__name__}: "
                                         f"{err}); start it with python -m tool_server ... first.") from None
            check_resume(args.out, settings)
            store = TraceStore(args.out / "traces.jsonl")
            write_settings(args.out, {**settings, "status": "running"})
            try:
                report, tool_stats, tool_spend = asyncio.run(
                    run(args, config, rows, tokenizer, tool_url, store, judge_overrides))
            finally:
                store.close()
    except EvalInputError as err:
        print(f"evaluate: error: {err}", file=sys.stderr)
        return 2

    keys = [row.run_key(run) for row in rows for run in range(config.runs)]
    records = [store.records[key] for key in keys if key in store]
    table = summarize(records, config.judge, report.failed, runs=config.runs)
    md_path, _ = write_tables(table, settings, args.out)
    write_plots(records, table, args.out)
    comparison = None
    if recipe is not None:
        from igpo.launch.recipes import comparison_table

        # reads the per-source rows; its AVG is over the paper's sets. With --runs k it gets questions and avg@k.
        k = config.runs
        ours = [{**line, "n": line.get("questions", line["n"]),
                 **{m: line[f"{m}_avg@{k}"] for m in ("em", "f1", "judge") if f"{m}_avg@{k}" in line}}
                for line in table]
        comparison = comparison_table(recipe, ours)
        if config.runs > 1:
            comparison += (f"\nOurs: avg@{config.runs} over {config.runs} sampled runs per question (temperature "
                           f"{config.temperature}, top-p {config.top_p}); results.md has pass@{config.runs}.")
        # the recipe names the paper's corpus; say what this run searched, so a rehearsal is not read as a result
        tools = settings["tools"]
        comparison += (f"\nThis run's tools: backend `{tools.get('backend')}` at "
                       f"`{tools.get('corpus') or tools.get('url')}`, top-k {tools.get('top_k')}.")
        (args.out / "comparison.md").write_text(comparison + "\n", encoding="utf-8")
    from igpo.reward import judge_metrics

    settings.update({
        "status": "complete" if not report.failed else "incomplete",
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "run": {"rows": len(rows), "runs": config.runs, "pairs": report.total, "resumed": report.resumed,
                "finished": report.finished, "failed": len(report.failed), "rejudged": report.rejudged,
                "rollout_s": round(report.seconds, 1)},
        "failed_rows": [{"data_source": s, "index": i, "run": r, "error": e}
                        for (s, i, r), e in sorted(report.failed.items())],
        "judge_metrics": judge_metrics() if config.judge else None, "tool_server_stats": tool_stats,
        "tool_spend": tool_spend,
    })
    write_settings(args.out, settings)
    print(md_path.read_text(encoding="utf-8"))
    if comparison is not None:
        print(comparison + "\n")
    if report.failed:
        distinct = sorted(set(report.failed.values()))
        what = "row(s)" if config.runs == 1 else "(question, run) pair(s)"
        print(f"evaluate: {len(report.failed)} {what} failed and are not scored ({len(distinct)} distinct errors, "
              f"first: {distinct[0]}); rerun the same command to redo them.", file=sys.stderr)
    if tool_spend is not None:
        ratio = tool_spend["cache_hit_ratio"]
        print(f"evaluate: tools: {tool_spend['calls']:.0f} calls, "
              f"{sum(tool_spend['upstream_calls'].values()):.0f} upstream calls, cache hit ratio "
              f"{'n/a (no cache lookups)' if ratio is None else f'{ratio:.3f}'}, estimated spend "
              f"${tool_spend['estimated_cost_usd']:.4f} (--tool-price)")
    average = table[-1]
    judge_part = f" judge={average['judge']:.3f}" if config.judge and average.get("judge") is not None else ""
    k = config.runs
    unit = "rows" if k == 1 else f"(question, run) pairs ({len(rows)} questions x {k} runs)"
    at_k = "".join(f" {m.upper()} avg@{k}={average[f'{m}_avg@{k}']:.3f} pass@{k}={average[f'{m}_pass@{k}']:.3f}"
                   for m in ("em", "f1") if k > 1 and average.get(f"{m}_avg@{k}") is not None)
    print(f"evaluate: {len(records)}/{len(keys)} {unit} scored, AVG EM={average['em']:.3f} F1={average['f1']:.3f}"
          f"{judge_part}{at_k} in {time.perf_counter() - started:.1f}s -> {args.out}"
          if records else f"evaluate: no row scored -> {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
