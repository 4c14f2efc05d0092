"""The errors flexsgl raises, by who has to act on them.

- `InputError` and its kinds (`PromptError`, `SamplingParamsError`, `CheckpointError`,
  `UnknownRequestError`) are `ValueError`s: the caller's input is wrong, and the message says what
  and why in one sentence.
  The engine is untouched by them. (The CLI prints them as `error: ...` and exits 2.)
- `EngineDeadError` is a `RuntimeError`: the engine can never run again, because the device failed
  (a CUDA error), a tensor-parallel rank died, or its state can no longer be trusted. Every later
  call raises it again at once, with the first reason.
- Tensor parallelism: `TensorParallelError` (an `InputError`) refuses a setting that cannot run
  before anything loads; `RankFailedError` (a `RuntimeError`) is another rank's failure while the
  engine starts, naming the rank.

A fault that concerns only some requests (a failed step, a callback that raised) is not raised:
those requests finish with reason "error" and the reason in `RequestOutput.error`.
"""

from __future__ import annotations

import torch


class InputError(ValueError):
    """Bad input from the caller."""


class PromptError(InputError):
    """A prompt that cannot be run: wrong type, empty, outside the vocabulary or the context."""


class SamplingParamsError(InputError):
    """Sampling parameters of the wrong type or out of range."""


class UnknownRequestError(InputError):
    """A request id that names no request of this engine (`LLM.abort`)."""


class CheckpointError(InputError):
    """A model directory that cannot be served: its config, weights or tokenizer."""


class TensorParallelError(InputError):
    """A tensor-parallel setting that cannot run here (ranks, GPUs, heads), or a rank that failed
    to load the model for a reason of that kind (its message names the rank)."""


class RankFailedError(RuntimeError):
    """Another tensor-parallel rank failed while the engine started (its message names the rank)."""


class EngineDeadError(RuntimeError):
    """The engine failed in a way that leaves it unable to run; make a new one (after a device
    fault, in a new process)."""


# Messages of device faults that leave a CUDA context unusable. An out-of-memory error is not one
# of them: it fails one step, and the device stays usable.
DEVICE_FAULTS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "illegal memory access",
                 "unspecified launch failure")


def is_device_fault(e: BaseException) -> bool:
    """Whether `e` says the accelerator itself failed (torch's AcceleratorError, or a CUDA error)."""
    if isinstance(e, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in DEVICE_FAULTS)


def describe(e: BaseException, limit: int = 300) -> str:
    """`TypeName: first line of the message`, without a final period, for one-sentence reports."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip().rstrip(".") if lines else ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def short_repr(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters, for messages that quote what the caller passed."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Health:
    """Whether an engine can still run. Once killed it stays dead, and check() raises
    EngineDeadError with the first reason."""

    def __init__(self):
        self.reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.reason is None

    def check(self) -> None:
        if self.reason is not None:
            raise EngineDeadError(self.message())

    def kill(self, reason: str) -> EngineDeadError:
        """Mark the engine dead (keeping an earlier reason); returns the error to raise."""
        self.reason = self.reason or reason
        return EngineDeadError(self.message())

    def check_device(self, e: Exception, device: torch.device) -> None:
        """Kill the engine and raise if `e` is a fault of the device itself, or left one behind
        (a CUDA fault surfaces at the next synchronisation)."""
        if is_device_fault(e) or not _synchronizes(device):
            raise self.kill(f"the device failed ({describe(e)})") from e

    def message(self) -> str:
        return (f"The engine cannot run any more: {self.reason}; create a new LLM (after a device fault, "
                "in a new process).")


def _synchronizes(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return False
    return True
