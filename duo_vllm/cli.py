"""duo-vllm: prepare the default model pair, generate and serve with DuoProposer."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

DEFAULT_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Translate to French: The weather is nice today and we are going to the park.",
]


def speculative_config(num_speculative_tokens: int, duo: dict | None = None) -> dict:
    """The ``speculative_config`` dict that plugs DuoProposer into vLLM."""
    spec = {"model": "duo_vllm.DuoProposer", "num_speculative_tokens": num_speculative_tokens}
    if duo:
        spec["draft_load_config"] = {"model_loader_extra_config": {"duo": duo}}
    return spec


def set_cpu_defaults(target_cores: str) -> None:
    """Bind vLLM-CPU's target to ``target_cores`` and give it 1 GiB of KV cache, unless set."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", target_cores)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def spec_decode_metrics(llm) -> dict:
    """vLLM's own speculative-decoding counters (needs ``disable_log_stats=False``)."""
    wanted = {"vllm:spec_decode_num_drafts": "drafts",
              "vllm:spec_decode_num_draft_tokens": "proposed",
              "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out, nan = {v: 0 for v in wanted.values()}, float("nan")
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[wanted[metric.name]] += metric.value
    out["mean_accepted_length"] = 1 + out["accepted"] / out["drafts"] if out["drafts"] else nan
    out["acceptance_rate"] = out["accepted"] / out["proposed"] if out["proposed"] else nan
    return out


def draft_stats(llm) -> dict:
    """DuoProposer.stats() from a local engine's worker, or ``{"error": ...}``; needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (it sends the worker a function)."""
    try:
        return llm.llm_engine.collective_rpc(lambda self: self.model_runner.drafter.stats())[0]
    except Exception as e:
        return {"error": repr(e)}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _default_target() -> str:
    from duo_vllm.models import prepare_default_target

    return prepare_default_target(log=_stderr)


def _cmd_prepare(args) -> int:
    from duo_vllm.models import prepare_default_target

    print(prepare_default_target())
    return 0


def _cmd_generate(args) -> int:
    duo = json.loads(args.duo_config) if args.duo_config else None
    on_cpu = cpu_platform()
    if on_cpu:
        set_cpu_defaults(args.target_cores or default_target_cores(duo))
    if not args.verbose:  # stdout: the answers and the summary; vLLM's warnings on stderr
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    target = args.target or _default_target()
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, max_model_len=args.max_model_len, seed=0, dtype=args.dtype,
              speculative_config=speculative_config(args.k, duo), disable_log_stats=False)
    prompts = args.prompt or DEFAULT_PROMPTS
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0, ignore_eos=args.ignore_eos)
    llm.generate(texts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    before = spec_decode_metrics(llm)
    n_tokens, elapsed = 0, 0.0
    for prompt, text in zip(prompts, texts):  # one request at a time: latency
        t0 = time.perf_counter()
        out = llm.generate([text], params, use_tqdm=False)[0].outputs[0]
        elapsed += time.perf_counter() - t0
        n_tokens += len(out.token_ids)
        print(f"### {prompt}\n{out.text}\n")
    after = spec_decode_metrics(llm)
    drafts, proposed, accepted = (after[k] - before[k] for k in ("drafts", "proposed", "accepted"))
    print(f"--- {len(prompts)} answer(s), one request at a time: {n_tokens} tokens in "
          f"{elapsed:.1f} s, {n_tokens / elapsed:.1f} tokens/s")
    print(f"--- draft: {accepted} of {proposed} proposed tokens accepted "
          f"({(accepted / proposed if proposed else 0):.0%}), "
          f"{(1 + accepted / drafts) if drafts else float('nan'):.2f} tokens per target step "
          f"with a draft ({drafts} such steps)")
    if on_cpu:
        print(f"--- target bound to CPU(s) {os.environ['VLLM_CPU_OMP_THREADS_BIND']}; the "
              "draft's cores, and whether the target lends them, are in DuoProposer's log")
    return 0


SERVE_USAGE = ("duo-vllm serve [MODEL] [-k N] [--duo JSON] [--target-cores CPUS] [--dry-run] "
               "[vLLM flags...]")
SERVE_DESCRIPTION = """\
Start vLLM's OpenAI API server with DuoProposer. Flags not listed below go to vLLM's
server as is (--host, --port, --max-model-len, ...). MODEL (or --model) is the target;
default: `duo-vllm prepare`'s, in float32 unless --dtype says otherwise.

Unless set, the environment gets, on vLLM-CPU, VLLM_CPU_OMP_THREADS_BIND (see
--target-cores) and VLLM_CPU_KVCACHE_SPACE=1, and PROMETHEUS_MULTIPROC_DIR (a temporary
directory, removed on exit), so that /metrics shows the draft's duo:* metrics.
"""


def default_target_cores(duo: dict | None = None, environ: dict | None = None) -> str:
    """The target's CPUs on vLLM-CPU when the user names none (``duo`` merged with
    ``$DUO_VLLM_CONFIG`` of ``environ``, as DuoProposer will): every CPU but the
    ``draft_cores``, or but the last unless ``lend_cores`` or ``lookup_only``; never none."""
    from duo_vllm.config import EXTRA_CONFIG_KEY, DuoConfig, allowed_cpus

    cfg = DuoConfig.from_sources({EXTRA_CONFIG_KEY: duo or {}}, environ)
    cpus = allowed_cpus()
    if cfg.draft_cores and not cfg.lookup_only:
        keep = [c for c in cpus if c not in set(cfg.draft_cores)]
    else:  # lend_cores: the draft shares the last CPU, lent back while it is off
        keep = cpus if cfg.lookup_only or cfg.lend_cores else cpus[:-1]
    return ",".join(str(c) for c in (keep or cpus))


def cpu_platform() -> bool:
    """Is the installed vLLM the CPU build (the only one the core binding applies to)?"""
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:
        return False


# duo-vllm serve's default: lookups copied from the context may fill SERVE_K tokens a step,
# the draft model drafts at most SERVE_MODEL_K of them
SERVE_K, SERVE_MODEL_K = 8, 4


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duo-vllm serve", usage=SERVE_USAGE,
                                description=SERVE_DESCRIPTION, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, metavar="N",
                   help=f"most draft tokens per request per step (default: {SERVE_K}, the "
                   f"draft model's at most {SERVE_MODEL_K}; {SERVE_MODEL_K} with lookup off)")
    p.add_argument("--duo", metavar="JSON",
                   help="DuoProposer options as a JSON object, or @file.json (README)")
    p.add_argument("--target-cores", metavar="CPUS",
                   help="vLLM-CPU: the target's CPUs (VLLM_CPU_OMP_THREADS_BIND; default: "
                        "every CPU, the last lent to the draft; see lend_cores)")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command only")
    return p


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a in names or a.split("=", 1)[0] in names for a in argv)


def _server_module() -> str:
    """vLLM's API server module: the launchers entry point where it exists (the old path
    is deprecated there), else ``vllm.entrypoints.openai.api_server``."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(root, "entrypoints", "launchers", "api_server",
                                       "entry.py")):
            return "vllm.entrypoints.launchers.api_server.entry"
    return "vllm.entrypoints.openai.api_server"


def build_serve_command(argv: list[str], environ: dict | None = None, default_model=None,
                        on_cpu=None) -> tuple[list[str], dict, argparse.Namespace]:
    """(command, environment, our options) for ``duo-vllm serve argv``; starts nothing.
    ``default_model()``: the target when none is named; ``on_cpu()``: is vLLM the CPU build."""
    parser = serve_parser()
    model, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else (None, argv)
    args, passthrough = parser.parse_known_args(rest)
    if _has_flag(passthrough, "--speculative-config", "--speculative_config"):
        parser.error("--speculative-config is set by duo-vllm serve; use "
                     "--num-speculative-tokens and --duo instead")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        parser.error("--num-speculative-tokens must be >= 1")
    duo = None
    if args.duo:
        from duo_vllm.config import DuoConfig, DuoConfigError, parse_json_option

        try:
            duo = parse_json_option(args.duo, source="--duo")
            DuoConfig.from_dict(duo)  # bad options fail here, not after vLLM has loaded
        except DuoConfigError as e:
            parser.error(str(e))
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = SERVE_MODEL_K
        if (duo or {}).get("lookup", True):
            args.num_speculative_tokens = SERVE_K
            duo = duo or {}
            duo = {**duo, "tuning": {"max_draft_len": SERVE_MODEL_K, **duo.get("tuning", {})}}
    env = dict(os.environ if environ is None else environ)
    if args.target_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.target_cores
    if (on_cpu or cpu_platform)():
        if "VLLM_CPU_OMP_THREADS_BIND" not in env:
            from duo_vllm.config import DuoConfigError

            try:
                env["VLLM_CPU_OMP_THREADS_BIND"] = default_target_cores(duo, env)
            except DuoConfigError as e:  # $DUO_VLLM_CONFIG's options
                parser.error(str(e))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from duo_vllm.config import forward_to_ray_workers

    env = forward_to_ray_workers(env)  # $DUO_VLLM_CONFIG under Ray data-parallel engines
    vllm_args = list(passthrough)
    if model is None and not _has_flag(passthrough, "--model"):
        model = (default_model or _default_target)()
        if not _has_flag(passthrough, "--dtype"):
            vllm_args = ["--dtype", "float32"] + vllm_args  # the default target's own dtype
    if model is not None:
        vllm_args = ["--model", model] + vllm_args
    cmd = [sys.executable, "-m", _server_module(), *vllm_args, "--speculative-config",
           json.dumps(speculative_config(args.num_speculative_tokens, duo))]
    return cmd, env, args


def _cmd_serve(argv: list[str]) -> int:
    cmd, env, args = build_serve_command(argv)
    made_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in env and not args.dry_run:  # before vLLM starts
        made_dir = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="duo-vllm-metrics.")
    ours = {k: v for k, v in env.items() if os.environ.get(k) != v}
    if args.dry_run:
        for k, v in ours.items():
            print(f"export {k}={shlex.quote(v)}")
        if "PROMETHEUS_MULTIPROC_DIR" not in env:
            print("# and PROMETHEUS_MULTIPROC_DIR: a fresh temporary directory")
        print(shlex.join(cmd))
        return 0
    print("[duo_vllm] " + " ".join(f"{k}={v}" for k, v in ours.items()), file=sys.stderr)
    try:
        proc = subprocess.Popen(cmd, env=env)

        def forward(signum, frame):  # vLLM ignores a repeated shutdown signal
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        return proc.wait()
    finally:
        if made_dir:
            shutil.rmtree(made_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # its own parser: unknown flags go to vLLM
        return _cmd_serve(argv[1:])
    parser = argparse.ArgumentParser(prog="duo-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="materialise the default target HF folder; print its path")
    gen = sub.add_parser("generate", help="generate with vLLM + DuoProposer")
    gen.add_argument("--target", help="target HF folder (default: the prepared default)")
    gen.add_argument("--dtype", default="float32",
                     help="target dtype (the default target is a float32 checkpoint)")
    gen.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    gen.add_argument("--prompt", action="append", help="user message (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--target-cores", help="VLLM_CPU_OMP_THREADS_BIND for the target, unless "
                     "set (default: as duo-vllm serve's)")
    gen.add_argument("--duo-config", help="DuoProposer options as a JSON object")
    gen.add_argument("--verbose", action="store_true",
                     help="vLLM's info log too (default: its warnings only, on stderr)")
    sub.add_parser("serve", help="vLLM's OpenAI API server with DuoProposer "
                   "(duo-vllm serve --help)", add_help=False)
    args = parser.parse_args(argv)
    commands = {"prepare": _cmd_prepare, "generate": _cmd_generate}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
