"""The engine process: the one owner of the LLM and its step loop.

It builds the LLM (and with it any other tensor-parallel ranks), says Ready (or StartFailed), then
adds the requests and aborts the HTTP process sends, runs steps, and sends one Step message per
step carrying every request's events: the text delta (detokenized here, incrementally), token id
and log-probabilities of each new token, each finished request's output, and the engine's stats.
When nothing runs it sleeps on its pipe. It ends on Stop, or when the HTTP process's end of the pipe
closes. Ctrl-C and SIGTERM, which a terminal or a service manager sends the whole process group, are
left to the HTTP process, which drains the requests in flight through this process and then sends
Stop (or kills it, where it does not end).

The step loop runs in its own process so that it never waits for the GIL behind the event loop's
per-token work (see docs/ARCHITECTURE.md, "The server").
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection

from flexsgl.errors import UnknownRequestError, describe
from flexsgl.log import logger
from flexsgl.request import Request
from flexsgl.serve.messages import Abort, Add, EngineInfo, Failed, Ready, StartFailed, Step, Stop


def main(engine_config, log_level: int, inbox: Connection, outbox: Connection) -> None:
    """The engine process's entry point (multiprocessing, spawn context)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logger.setLevel(log_level)
    from flexsgl.engine import LLM

    try:
        llm = LLM(engine_config)
    except Exception as e:
        outbox.send(StartFailed(f"The engine could not start: {describe(e)}."))
        return
    try:
        outbox.send(Ready(EngineInfo(llm.requests, llm.default_sampling, llm.pool.num_pages - 1), llm.stats()))
        logger.info("engine ready")
        _Loop(llm, inbox, outbox).run()
    except (BrokenPipeError, EOFError):  # the HTTP process has gone
        pass
    finally:
        llm.shutdown()


class _Loop:
    def __init__(self, llm, inbox: Connection, outbox: Connection):
        self.llm, self.inbox, self.outbox = llm, inbox, outbox
        self.sent_chars: dict[int, int] = {}  # per live request: characters of its text sent so far
        self.tokens: list = []  # this step's token events (Step.tokens)
        self.prompts: dict = {}  # this step's Step.prompts

    def run(self) -> None:
        llm = self.llm
        while self._take_inbox(block=not llm.has_unfinished):
            try:
                outs = llm.step()
            except BaseException as e:  # EngineDeadError (or a bug): nothing more can run
                logger.exception("the engine failed")
                self.outbox.send(Failed(f"The engine failed: {describe(e)}."))
                return
            finished = [(o.request_id, (o.text or "")[self.sent_chars.pop(o.request_id, 0):], o) for o in outs]
            tokens, self.tokens, prompts, self.prompts = self.tokens, [], self.prompts, {}
            self.outbox.send(Step(tokens, finished, llm.stats(), prompts))

    def _take_inbox(self, block: bool) -> bool:
        """Act on what the HTTP process sent (waiting for it when idle); False once told to stop."""
        while block or self.inbox.poll():
            msg = self.inbox.recv()  # EOFError once the HTTP process has gone
            block = False
            if isinstance(msg, Add):
                for r in msg.requests:
                    self.sent_chars[r.request_id] = 0
                self.llm.submit(msg.requests, self._on_token)
            elif isinstance(msg, Abort):
                for i in msg.request_ids:
                    try:
                        self.llm.abort(i)
                    except UnknownRequestError:  # never submitted here: nothing to stop
                        logger.debug("abort of unknown request %r", i)
            elif isinstance(msg, Stop):
                return False
        return True

    def _on_token(self, req: Request) -> None:
        self.sent_chars[req.request_id] += len(req.new_text)
        if len(req.output_ids) == 1 and req.sampling.prompt_logprobs is not None:  # a stream's echo shows them
            self.prompts[req.request_id] = (list(req.prompt_ids), req.prompt_logprobs)
        self.tokens.append((req.request_id, req.new_text, req.output_ids[-1],
                            req.logprobs[-1] if req.logprobs else None))
