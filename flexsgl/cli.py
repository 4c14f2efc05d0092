"""The `flexsgl` command line (typer)."""

from __future__ import annotations

import json
import os
import sys
import time

import typer

from flexsgl.cli_options import Command, engine_options, fail
from flexsgl.config import EngineConfig
from flexsgl.log import logger
from flexsgl.startup import process_seconds, ready_line, restore_interrupts

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="flexsgl: LLM inference on torch.compile + FlexAttention over a paged KV cache.")


@app.callback()
def main() -> None:
    """flexsgl's commands: generate, serve, bench, backends."""
    restore_interrupts()  # imported: from here Ctrl-C is a KeyboardInterrupt the commands handle


def generate_config(engine: EngineConfig, requests: int) -> EngineConfig:
    """`engine` for a run of `requests` requests known up front (`generate`'s prompts times n): at
    most that many running at once, so the KV pool (cache/sizing.py), the CUDA graphs and the
    decode kernels compiled while capturing them cover only the batch sizes the run can reach (a
    server's go up to max_running_requests, 256 by default). Given graph sizes beyond that reach are
    dropped, unless none would remain."""
    reach = min(requests, engine.max_running_requests)
    sizes = engine.cuda_graph_bs
    if sizes is not None:
        sizes = tuple(b for b in sizes if b <= reach) or sizes
    return engine.replace(max_running_requests=reach, cuda_graph_bs=sizes)


def shows_text(llm) -> bool:
    """Whether the outputs of `llm` read as text: not for a model without a tokenizer, nor for a
    preset's byte tokenizer, which comes with dummy weights (their tokens are random, and ids of
    256 and up are no byte at all)."""
    from flexsgl.tokenizer import ByteTokenizer

    return llm.tokenizer is not None and not isinstance(llm.tokenizer, ByteTokenizer)


class TokenPrinter:
    """Streams one request's prompt and text to stdout as tokens arrive (token ids, where the
    output has no text: shows_text)."""

    def __init__(self, llm, prompt: str):
        self.llm, self.prompt, self.shown = llm, prompt, ""
        self.text = shows_text(llm)
        self.first_token_at: float | None = None  # perf_counter() when the first token arrived

    def __call__(self, req) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.prompt is not None:
            sys.stdout.write(self.prompt)
            self.prompt = None
        text = self.llm.decode_text(req.output_ids) if self.text else None
        if text is None:
            sys.stdout.write(f" {req.output_ids[-1]}")
        elif not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(self.shown):])
            self.shown = text
        sys.stdout.flush()

    def finish(self, token_ids: list[int]) -> None:
        """Write what was held back (a character cut short by the end of generation)."""
        if self.text:
            sys.stdout.write(self.llm.decode_text(token_ids)[len(self.shown):])
        sys.stdout.write("\n")


@app.command(cls=Command)
@engine_options
def generate(
    prompts: list[str] = typer.Argument(None, help="One or more prompts."),
    max_new_tokens: int = typer.Option(32, help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 for greedy."),
    top_k: int = typer.Option(0, help="0 turns top-k off."),
    top_p: float = typer.Option(1.0),
    min_p: float = typer.Option(0.0),
    seed: int = typer.Option(None, help="Sampling seed (per request)."),
    n: int = typer.Option(1, help="Samples per prompt (they share the prompt's KV pages)."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past EOS."),
    json_out: bool = typer.Option(False, "--json", help="Print the outputs as JSON instead of streaming text."),
    *, engine: EngineConfig,
) -> None:
    """Generate continuations of PROMPTS; one prompt streams its tokens as they come."""
    from flexsgl import LLM, SamplingParams
    from flexsgl.errors import EngineDeadError, RankFailedError
    from flexsgl.request_factory import check_prompt

    if not prompts:
        fail("Give at least one prompt, e.g. flexsgl generate \"Return the\".")
    try:
        for i, p in enumerate(prompts):
            check_prompt(p, i)  # what needs no tokenizer, before the model loads
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, min_p=min_p, seed=seed, ignore_eos=ignore_eos, n=n)
        before_s, t0 = process_seconds(), time.perf_counter()  # t0 - before_s: the process's start
        llm = LLM(generate_config(engine, len(prompts) * n))
        ready = llm.startup_times()
        logger.info(ready_line(before_s + time.perf_counter() - t0, before_s, ready))
        stream = len(prompts) == 1 and n == 1 and not json_out
        if not json_out and llm.tokenizer is not None and not shows_text(llm):
            logger.info(f"{llm.src.name} has dummy (random) weights and a byte tokenizer, which give no readable "
                        "text: its token ids are shown instead")
        t1 = time.perf_counter()
        printer = TokenPrinter(llm, prompts[0]) if stream else None
        try:
            outs = llm.generate(prompts, sampling, on_token=printer)
        except KeyboardInterrupt:
            if printer is not None and printer.prompt is None:  # end the streamed line before the exit
                sys.stdout.write("\n")
            raise
        elapsed = time.perf_counter() - t1
        compiling = llm.startup_times()["compile_s"] - ready["compile_s"]
    except ValueError as e:
        fail(str(e))
    except (EngineDeadError, RankFailedError) as e:
        fail(str(e), code=1)
    if all(o.finish_reason == "refused" for o in outs):  # nothing ran: say why, as for any other bad input
        fail(outs[0].error)
    asked = [p for p in prompts for _ in range(n)]  # outputs come in prompt order, n in a row
    if json_out:
        typer.echo(json.dumps([{"prompt": p, "index": o.index, "text": o.text, "token_ids": o.token_ids,
                                "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
                                "finish_reason": o.finish_reason, "error": o.error}
                               for p, o in zip(asked, outs)], indent=2))
        return
    if stream:
        printer.finish(outs[0].token_ids)
        if printer.first_token_at is not None:
            logger.info(f"first token {before_s + printer.first_token_at - t0:.1f}s after start")
    else:
        for p, o in zip(asked, outs):
            shown = o.text if o.text is not None and shows_text(llm) else " " + " ".join(map(str, o.token_ids))
            typer.echo(f"{p} [{o.error}]" if o.error else f"{p}{shown}")
            typer.echo("---")
    n = sum(len(o.token_ids) for o in outs)
    logger.info(f"{n} tokens in {elapsed:.2f}s ({n / max(elapsed, 1e-9):.1f} tok/s"
                + (f"; {compiling:.1f}s of it compiling new shapes, {n / max(elapsed - compiling, 1e-9):.1f} tok/s "
                   "without" if compiling else "") + "); finish: " + ", ".join(sorted({o.finish_reason for o in outs})))
    failed = [o.error for o in outs if o.finish_reason == "error"]
    if failed:  # a fault, not bad input: the others' outputs are above
        fail(failed[0] if len(failed) == 1 else f"{len(failed)} requests failed; the first: {failed[0]}", code=1)


@app.command(cls=Command)
@engine_options(exclude=("override", "random_seed"))
def bench(
    workload: str = typer.Option("throughput", help="throughput (offline), latency (TTFT, TPOT, % of the "
                                 "decode floor), prefill (TTFT of long prompts) or serve (flexsgl serve under "
                                 "Poisson load: throughput, TTFT, TPOT, ITL percentiles)."),
    num_prompts: int = typer.Option(None, help="throughput, serve: requests (default 256)."),
    input_len: str = typer.Option(None, help="Prompt tokens. throughput: MIN:MAX (default 100:1024); "
                                  "latency: N (default 1024); prefill: N[,N...] (default 4096,16384); "
                                  "defaults are cut to fit a shorter context."),
    output_len: str = typer.Option(None, help="Output tokens, EOS ignored. throughput: MIN:MAX (default "
                                   "100:1024); latency: N (default 256)."),
    batch_size: int = typer.Option(None, help="latency: requests decoded together (default 1)."),
    repeats: int = typer.Option(None, help="latency, prefill: timed passes after the warm-up (default 3)."),
    override: list[str] = typer.Option(None, help="Attention backend(s); repeat to compare, e.g. "
                                       "--override flex --override fa3-prefill,fi-decode (default: auto)."),
    seed: int = typer.Option(0, help="Seed of the random prompts and lengths (and of dummy weights)."),
    json_path: str = typer.Option(None, "--json", help="Also write every figure, the machine and the arguments here."),
    request_rate: str = typer.Option(None, help="serve: requests per second, Poisson arrivals, or inf (default); "
                                     "several (8,32,inf) are timed one after another on one server."),
    max_concurrency: int = typer.Option(None, help="serve: most requests in flight (default: no limit)."),
    base_url: str = typer.Option(None, help="serve: measure this running server (http://HOST:PORT: flexsgl, vLLM, "
                                 "SGLang or any OpenAI-compatible one; pass its --model) instead of starting one "
                                 "per --override."),
    dataset_path: str = typer.Option(None, help="serve: a ShareGPT-format JSON file; each request is a conversation's "
                                     "first turn, its output as long as the reply (or --output-len)."),
    structured: str = typer.Option(None, help="serve: constrain every output to a JSON schema (json-schema), to "
                                   "compare with an unconstrained run."),
    *, engine: EngineConfig,
) -> None:
    """Measure throughput, latency, prefill or serving on one or more attention backends; one table, one column
    each. A preset runs with dummy weights unless --load-format says otherwise."""
    from flexsgl import bench as b
    from flexsgl.bench import format_table, write_json
    from flexsgl.errors import EngineDeadError, RankFailedError

    args = b.BenchArgs(workload=workload, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                       batch_size=batch_size, repeats=repeats, overrides=list(override or []), seed=seed,
                       engine=engine, request_rate=request_rate, max_concurrency=max_concurrency, base_url=base_url,
                       dataset_path=dataset_path, structured=structured)
    if json_path and not os.path.isdir(os.path.dirname(os.path.abspath(json_path))):
        fail(f"The folder of --json {json_path!r} does not exist.")
    try:
        report = b.run(b.plan(args))
    except ValueError as e:
        fail(str(e))
    except (EngineDeadError, RankFailedError) as e:
        fail(str(e), code=1)
    typer.echo(format_table(report))
    if json_path:
        try:
            write_json(report, json_path)
        except OSError as e:
            fail(f"Could not write {json_path!r}: {e.strerror or e}.")
        typer.echo(f"[flexsgl bench] wrote {json_path}", err=True)


@app.command(cls=Command)
@engine_options(exclude=("model",))
def serve(
    model: str = typer.Argument(None, help="Preset, local HF model directory or hub id (default: the embedded model)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    served_model_name: list[str] = typer.Option(None, help="The model name clients pass (default: MODEL as "
                                                "given); repeat it for several, which requests may name "
                                                "alike (responses carry the first)."),
    api_key: str = typer.Option(None, help="Clients must send 'Authorization: Bearer KEY' (default: no key; "
                                "/health and /metrics stay open)."),
    chat_template: str = typer.Option(None, help="A Jinja chat template (a file, or the template itself) used "
                                      "in place of the model's."),
    reasoning_parser: str = typer.Option(None, help="Move <think>...</think> into reasoning_content: qwen3 or "
                                         "deepseek_r1."),
    tool_call_parser: str = typer.Option(None, help="Parse tool calls of tool_choice auto: hermes (also qwen3), "
                                         "llama3_json or mistral."),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice", hidden=True,
                                                 help="Accepted for vLLM's command lines; --tool-call-parser "
                                                 "turns auto tool choice on."),
    enable_log_requests: bool = typer.Option(False, "--enable-log-requests", "--enable-request-log",
                                             help="Log each request's prompt, parameters and end."),
    max_request_bytes: int = typer.Option(None, help="Largest request body taken; a larger one is answered "
                                          "413 (default: 64 MiB)."),
    *, engine: EngineConfig,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /tokenize, /detokenize, /health, /metrics), streaming with stream: true."""
    try:
        from flexsgl.serve import listen, serve as run_server
        from flexsgl.serve.app import DEFAULT_MAX_REQUEST_BYTES, ServerOptions
        import fastapi, uvicorn, prometheus_client  # noqa: F401  (the serve extra)
    except ImportError as e:
        fail(f"flexsgl serve needs FastAPI, uvicorn and prometheus_client ({e.name} is missing): "
             "pip install 'flexsgl[serve]'.")
    if not 0 < port < 65536:
        fail(f"--port must be from 1 to 65535, got {port}.")
    from flexsgl.serve import reasoning, tools

    if reasoning_parser is not None and reasoning_parser.replace("-", "_") not in reasoning.PARSERS:
        fail(f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(reasoning.PARSERS)}.")
    if tool_call_parser is not None and tool_call_parser not in tools.PARSERS:
        fail(f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(tools.PARSERS)}.")
    if max_request_bytes is not None and max_request_bytes < 1024:
        fail(f"--max-request-bytes must be at least 1024, got {max_request_bytes}.")
    if api_key is not None and not api_key:
        fail("--api-key must not be empty.")
    if served_model_name and not all(name.strip() for name in served_model_name):
        fail("--served-model-name must not be empty.")
    try:
        from flexsgl.model.presets import DEFAULT_MODEL
        from flexsgl.model.source import resolve
        from flexsgl.chat_template import checked_template

        options = ServerOptions(api_key=api_key, chat_template=chat_template and checked_template(chat_template),
                                reasoning_parser=reasoning_parser and reasoning_parser.replace("-", "_"),
                                tool_call_parser=tool_call_parser, request_log=enable_log_requests,
                                max_request_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
        config = engine.replace(model=model)
        # A model that cannot be found, options that cannot run together: say so now.
        config.resolve(resolve(config.model or DEFAULT_MODEL, config.load_format, config.context_length).config)
        sock = listen(host, port)
    except (ValueError, OSError) as e:
        fail(str(e))
    run_server(config, host=host, port=port, served_model_name=served_model_name, options=options, sock=sock)


@app.command(cls=Command)
def backends(device: str = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when there is one).")) -> None:
    """List every attention backend: its phases, whether it runs on this machine, and if not, why."""
    import torch

    from flexsgl.attention.registry import table

    try:
        dev = EngineConfig(device=device).torch_device
    except ValueError as e:
        fail(str(e))
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    typer.echo(f"attention backends on {where} (models: GQA = Qwen3, Llama; MLA = DeepSeek-V2)")
    rows = [("name", "phases", "models", "variants", "runs here", "about (and why not)")]
    rows += [(r["name"], r["phases"], r["models"], r["variants"], "yes" if r["runs_here"] else "no",
              r["about"] + (f"; not here: {r['why_not']}" if r["why_not"] else "")) for r in table(dev)]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    typer.echo("variants: the attention-variant features a backend runs (docs/ATTENTION.md); all: any variant, "
               "its Python mods included")


@app.command(cls=Command)
def cache(clear: bool = typer.Option(False, "--clear", help="Delete the cached compiled code.")) -> None:
    """Show where torch.compile's caches live (compiled code reused across processes), or clear them."""
    from flexsgl import compile_cache

    path = compile_cache.cache_dir()
    if clear:
        typer.echo(f"cleared {path} ({compile_cache.clear() / 1e6:,.1f} MB)")
    else:
        typer.echo(f"{path} ({compile_cache.size_bytes(path) / 1e6:,.1f} MB); set {compile_cache.ENV} to move it")


if __name__ == "__main__":
    app()
