"""What the batch-1 matrix-vector kernel (flexsgl/kernels/gemv.py) executes per weight byte on SM90,
read from its machine code: no GPU needed.

It compiles the kernel for SM90 as a launch would specialise it (pointers, N, K and the row stride
divisible by 16, K a multiple of the tile), disassembles the cubin with the nvdisasm that Triton's
wheel carries, finds the loop over K slices (the code between the loop's label and the branch back
to it) and prints its instruction mix, its loads' widths and its instructions per weight byte a
thread. A kernel that must stream weights at the copy bandwidth can spend only so many issue slots
per byte: an H200 SM issues 4 warp instructions (128 threads') a clock and must take in 16-18 bytes
a clock, so at 3.7 instructions a byte the loop takes about half of them. The counts belong to the
installed Triton: compare with the device image's version (printed first).

    python tools/gemv_sass.py --fp8 --tiles 8,2048,8,2     # the FP8 tiles (FP8_TILES; FP8_NORM_TILES: rms_norm)
    python tools/gemv_sass.py --tiles 4,512,4,3            # bfloat16 weights, o_proj's tiles
    python tools/gemv_sass.py --fp8 --prologue rms_norm --block-scales   # qkv's form, block-wise FP8

FP8 forms compile under the register cap their launches take (gemv.FP8_MAX_REGISTERS); the tool
prints the registers and the bytes a thread spills.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from flexsgl.kernels import gemv
from flexsgl.tool_args import positive_ints

ALIGNED = ("x_ptr", "w_ptr", "b_ptr", "r_ptr", "g_ptr", "out_ptr", "N", "K", "stride_wn", "e_ptr", "s_ptr")
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


@dataclass
class LoopMix:
    triton_version: str
    registers: int
    spilled: int  # bytes a thread spilled to local memory (cuobjdump's STACK)
    ops: collections.Counter  # full opcodes (with modifiers) in one iteration of the loop over K
    bytes_per_thread: int  # weight bytes a thread reads an iteration

    @property
    def instructions(self) -> int:
        return sum(self.ops.values())


def sass(fp8: bool, tiles: tuple[int, int, int, int], prologue: int = gemv.PLAIN,
         block_scales: bool = False) -> tuple[str, int, int, str]:
    """(the kernel's SM90 disassembly, its registers a thread and spilled bytes a thread (cuobjdump's
    REG and STACK), Triton's version) for a projection in one of the engine's forms: the given
    prologue, a residual but after RMSNorm (norm_linear takes none), FP8 weights with row scales
    (128 x 128 block scales with block_scales) or bf16, compiled as a launch of the engine's
    projections would be, FP8 capped at gemv.FP8_MAX_REGISTERS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_n, block_k, warps, stages = tiles
    kernel = gemv._kernel()
    weight = "*fp8e4nv" if fp8 else "*bf16"
    norm = "*bf16" if prologue == gemv.RMS_NORM else weight  # the norm weight, or the unused pointer's stand-in
    signature = {"x_ptr": "*bf16", "w_ptr": weight, "b_ptr": weight, "r_ptr": "*bf16", "g_ptr": norm,
                 "out_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32", "eps": "fp32", "e_ptr": weight,
                 "stride_we": "i32", "stride_xs": "i32", "stride_os": "i32", "s_ptr": "*fp32" if fp8 else weight,
                 "stride_sn": "i32"}
    scale = (gemv.BLOCK_SCALE if block_scales else gemv.ROW_SCALE) if fp8 else gemv.NO_SCALE
    constants = dict(PROLOGUE=prologue, HAS_BIAS=False, HAS_RESIDUAL=prologue != gemv.RMS_NORM, SCALE=scale,
                     SCALE_N=128 if block_scales else 1, SCALE_K=128 if block_scales else 1, BLOCK_N=block_n,
                     BLOCK_K=block_k, EVEN_K=True, PDL=True, STACKED=False, INNER=gemv.FP8_INNER if fp8 else 1)
    signature.update({name: "constexpr" for name in constants})
    names = list(kernel.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages,
                                       **({"maxnreg": gemv.FP8_MAX_REGISTERS} if fp8 else {})})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "gemv.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout
    registers, stack = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return text, registers, stack, triton.__version__


def loop_mix(fp8: bool, tiles: tuple[int, int, int, int], prologue: int = gemv.PLAIN,
             block_scales: bool = False) -> LoopMix:
    """The instruction mix of one iteration of the kernel's loop over K slices."""
    text, registers, spilled, version = sass(fp8, tiles, prologue, block_scales)
    lines = text.splitlines()
    back = [(i, m.group(1)) for i, line in enumerate(lines)
            if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line))]
    labels = {line.rstrip(":").strip(): i for i, line in enumerate(lines) if re.match(r"^\s*\.L_x_\d+:", line)}
    # backward branches, but for the one-instruction loop every kernel ends with (after EXIT)
    loops = [(labels[target], i) for i, target in back if target in labels and labels[target] < i - 1]
    if len(loops) != 1:
        raise SystemExit(f"gemv_sass: expected one loop over K in the kernel, found {len(loops)}")
    start, end = loops[0]
    ops = collections.Counter(m.group(1) for line in lines[start:end + 1] if (m := OPCODE.search(line)))
    block_n, block_k, warps, _ = tiles
    element = 1 if fp8 else 2
    return LoopMix(version, registers, spilled, ops, block_n * block_k * element // (warps * 32))


def tiles_arg(text: str) -> tuple[int, int, int, int]:
    """BLOCK_N,BLOCK_K,warps,stages: four positive numbers, BLOCK_N, BLOCK_K and warps powers of two."""
    values = positive_ints(text)
    if len(values) != 4 or any(v & (v - 1) for v in values[:3]):
        raise argparse.ArgumentTypeError(f"{text!r} is not BLOCK_N,BLOCK_K,warps,stages with the first three "
                                         "powers of two")
    return tuple(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true", help="FP8 weights with a scale per row (else bfloat16)")
    ap.add_argument("--tiles", type=tiles_arg, default=None,
                    help="BLOCK_N,BLOCK_K,warps,stages (default: the engine's for the form at 4096 x 4096)")
    ap.add_argument("--prologue", choices=list(gemv.PROLOGUES), default="plain",
                    help="what the kernel does to x first: nothing (o_proj), RMSNorm (qkv, gate_up), SiLU gate (down)")
    ap.add_argument("--block-scales", action="store_true", help="with --fp8: 128 x 128 block scales (else per row)")
    ap.add_argument("--json", action="store_true", help="the loop's mix as one JSON object")
    args = ap.parse_args()
    if args.block_scales and not args.fp8:
        ap.error("--block-scales applies to FP8 weights: add --fp8")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("gemv_sass: compiles the kernel; unset TRITON_INTERPRET")
    tiles = (args.tiles if args.tiles
             else gemv.config_for(4096, 4096, args.fp8, gemv.PROLOGUES[args.prologue], args.block_scales))
    mix = loop_mix(args.fp8, tiles, gemv.PROLOGUES[args.prologue], args.block_scales)
    if args.json:
        print(json.dumps({"triton": mix.triton_version, "tiles": tiles, "registers": mix.registers,
                          "spilled": mix.spilled,
                          "bytes_per_thread": mix.bytes_per_thread, "ops": dict(mix.ops)}))
        return
    print(f"triton {mix.triton_version}; {'FP8' if args.fp8 else 'bfloat16'} weights, tiles {tiles}: "
          f"{mix.registers} registers a thread, {mix.spilled} bytes spilled")
    print(f"loop over K: {mix.instructions} instructions an iteration for {mix.bytes_per_thread} weight bytes a "
          f"thread, {mix.instructions / mix.bytes_per_thread:.2f} a byte")
    for op, n in mix.ops.most_common(16):
        print(f"{n:6d}  {op}")


if __name__ == "__main__":
    main()
