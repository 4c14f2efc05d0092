"""Train flexsgl's embedded default model: a tiny Qwen3 on the standard library's own documentation.

Corpus: the docstrings of every importable standard-library module, class and routine (collected
with `inspect`), plus pydoc's language topics. A fixed share of documents is held out. Tokenizer:
byte-level BPE (HF `tokenizers`). Model: HF transformers' Qwen3ForCausalLM at a few million
parameters, trained with a plain PyTorch loop (AdamW, cosine schedule, bf16 autocast on CUDA).
Held-out bits per byte are reported; the checkpoint with the best held-out loss is saved as an
ordinary HF model directory (config.json, model.safetensors, tokenizer files).

Deterministic given --seed on one Python version (the corpus is that version's stdlib):
    python tools/train_tiny.py --out flexsgl/data/tiny-docs
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import sys
import time
import warnings

import torch

from flexsgl.tool_args import positive_int

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "lib2to3",
        "ensurepip", "venv", "test", "msilib", "webbrowser", "pydoc_data", "unittest"}
EOS = "<|endoftext|>"


def _import(name: str):
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # some modules exit, need a display or a platform: skip them
        return None


def stdlib_modules() -> list:
    mods = []
    for name in sorted(sys.stdlib_module_names):
        if name in SKIP or name.startswith("_") or (m := _import(name)) is None:
            continue
        mods.append(m)
        for info in pkgutil.walk_packages(getattr(m, "__path__", []), name + "."):
            parts = info.name.split(".")[1:]
            if not any(p.startswith("_") or p in ("test", "tests", "idle_test") for p in parts):
                if (sub := _import(info.name)) is not None:
                    mods.append(sub)
    return mods


def _doc(obj) -> str | None:
    try:
        return inspect.getdoc(obj)
    except Exception:
        return None


def collect_corpus() -> list[str]:
    """Unique documentation texts, in a deterministic order."""
    docs: dict[str, None] = {}
    for m in stdlib_modules():
        for obj in [m] + [o for _, o in inspect.getmembers(m) if inspect.isclass(o) or inspect.isroutine(o)]:
            if d := _doc(obj):
                docs[d] = None
            if inspect.isclass(obj):
                for _, meth in inspect.getmembers(obj):
                    if inspect.isroutine(meth) and (d := _doc(meth)):
                        docs[d] = None
    from pydoc_data.topics import topics

    for key in sorted(topics):
        docs[topics[key].strip()] = None
    return sorted(docs)


def is_held_out(doc: str, share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc.encode()).digest()[:8], "little")
    return h / 2**64 < share


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    ids = []
    for ids_doc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(ids_doc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def held_out_bits_per_byte(model, stream, n_bytes, seq_len, device, batch=32) -> float:
    """Summed next-token loss over the held-out stream, in bits, per UTF-8 byte of its text."""
    model.eval()
    total = 0.0
    windows = stream[: (len(stream) - 1) // seq_len * seq_len + 1]
    x_all = windows[:-1].view(-1, seq_len)
    y_all = windows[1:].view(-1, seq_len)
    for i in range(0, len(x_all), batch):
        x, y = x_all[i:i + batch].to(device), y_all[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    covered = n_bytes * (x_all.numel() / max(len(stream) - 1, 1))
    return total / math.log(2) / covered


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=positive_int, default=800)
    ap.add_argument("--batch", type=positive_int, default=64)
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=positive_int, default=4096)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--inter", type=positive_int, default=512)
    ap.add_argument("--held-out", type=float, default=0.05)
    ap.add_argument("--eval-every", type=positive_int, default=250)
    args = ap.parse_args()
    if args.hidden % 64:
        ap.error(f"--hidden must be a multiple of 64 (heads of 64 dimensions), got {args.hidden}")
    if not 0 < args.held_out < 1:
        ap.error(f"--held-out must be a fraction between 0 and 1, got {args.held_out}")

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    docs = collect_corpus()
    train_docs = [d for d in docs if not is_held_out(d, args.held_out)]
    test_docs = [d for d in docs if is_held_out(d, args.held_out)]
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f}M chars; held out {len(test_docs)} "
          f"({time.time() - t0:.1f}s)", flush=True)
    tokenizer = train_tokenizer(train_docs, args.vocab)
    train = token_stream(tokenizer, train_docs)
    test = token_stream(tokenizer, test_docs)
    test_bytes = sum(len(d.encode()) + 1 for d in test_docs)
    print(f"tokens: train {len(train):,}, held out {len(test):,} ({time.time() - t0:.1f}s)", flush=True)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = args.hidden // 64
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.inter,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=64, max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.02)
    config._attn_implementation = "eager"  # deterministic backward, unlike cuDNN's fused attention
    model = Qwen3ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters on {device}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    best, best_state, best_step = float("inf"), None, 0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=gen)
        chunk = torch.stack([train[s:s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(chunk[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            bpb = held_out_bits_per_byte(model, test, test_bytes, args.seq_len, device)
            if bpb < best:
                best, best_step = bpb, step
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            print(f"step {step:5d}  train loss {loss.item():.3f}  held-out bits/byte {bpb:.3f}  "
                  f"({time.time() - t0:.0f}s)", flush=True)

    model.load_state_dict(best_state)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {"held_out_bits_per_byte": round(best, 4), "best_step": best_step, "steps": args.steps,
              "params": n_params, "train_tokens": len(train), "held_out_tokens": len(test),
              "seconds": round(time.time() - t0, 1), "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "python": sys.version.split()[0], "torch": torch.__version__, "args": vars(args)}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
