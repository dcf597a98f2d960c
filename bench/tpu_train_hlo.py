"""The training step as the TPU compiler builds it, without a TPU: compile train.py's step for one TPU v5e
chip on this CPU (libtpu's topology description, as compile_aot.py does), print XLA's memory analysis and
the step's memory-bound part: every top-level operation of the optimized program that is not a matmul,
a convolution or a custom call (splash's kernels), with the bytes it reads and writes in HBM and the time
those take at the chip's 819 GB/s, ranked, and totalled by where it runs and what kind it is.

    pip install --target /tmp/libtpu libtpu==0.0.42.1     # once; not a project dependency
    PYTHONPATH=/tmp/libtpu python bench/tpu_train_hlo.py config/gpt2_124m.py --batch_size=16 \\
        --gradient_accumulation_steps=1 [--top=25] [--hlo=saved.hlo]

An operation inside a loop counts once per trip (the layer scan: x n_layer). Bytes are those of the
arrays' tiled layouts (T(8,128): the two minor dimensions padded to 8 x 128) in HBM; arrays that XLA put
in the chip's VMEM (memory space S(1)) cost no HBM traffic and are left out, as are the asynchronous
copies between HBM and VMEM (prefetches that overlap compute; their total is printed apart). A fusion
that reads a slice of an operand (a layer's weights out of the stacked ones) counts the slice; one that
updates a slice in place (an activation saved into the stack, a layer's gradient) counts the update.
The matmul fusions are left out even where XLA fused an elementwise producer into them: their time is
the matmul's. Writes the optimized HLO to /tmp/tpu_train.hlo; --hlo=FILE reads one instead of compiling.
"""

import collections
import math
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_HOST_BOUNDS", "1,1,1")):
    os.environ.setdefault(key, value)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HBM_BYTES_PER_S = 819e9  # TPU v5e
BYTES_OF = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 1,
    "u4": 1,
}
# Operations that move no bytes of their own (or are accounted elsewhere: a loop's body, a fusion's callee).
FREE = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "while",
    "call",
    "conditional",
    "copy-done",
    "slice-done",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "opt-barrier",
}
ASYNC_MOVES = {"copy-start", "slice-start"}  # HBM <-> VMEM prefetches and evictions, overlapped with compute
LAYOUT_OPS = {
    "parameter",
    "bitcast",
    "copy",
    "transpose",
    "reshape",
    "slice",
    "tuple",
    "reduce-precision",
    "get-tuple-element",
    "concatenate",
}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*)$")


def array_bytes(hlo_type: str, hbm_only: bool = True) -> int:
    """Bytes of the arrays in an HLO type such as 'bf16[16,1024]{1,0:T(8,128)(2,1)S(1)}' (a tuple sums its
    parts), in their tiled layout; with hbm_only, arrays in another memory space (VMEM: S(1)) count 0."""
    total = 0
    for dtype, dims, layout in re.findall(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\](\{[^}]*\})?", hlo_type):
        if dtype not in BYTES_OF or (hbm_only and re.search(r"S\([1-9]\d*\)", layout or "")):
            continue
        shape = [int(d) for d in dims.split(",") if d]
        order = re.match(r"\{([\d,]*)", layout or "")
        tile = re.search(r":T\(([\d,]+)\)", layout or "")
        if shape and order and order.group(1) and tile:  # pad the minor dimensions to the first tile
            minor_to_major = [int(d) for d in order.group(1).split(",")]
            for dim, size in zip(minor_to_major, reversed([int(t) for t in tile.group(1).split(",")])):
                shape[dim] = -(-shape[dim] // size) * size
        total += math.prod(shape) * BYTES_OF[dtype]
    return total


def parse(text: str) -> tuple[dict, str]:
    """({computation: [(name, type, opcode, operand names, rest of the line)]}, the entry's name)."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(.*\{$", line)
        if head:
            current = head.group(2)
            computations[current] = []
            entry = current if head.group(1) else entry
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            name, hlo_type, opcode, rest = m.groups()
            args = rest.split("), ")[0] if "), " in rest else rest.rsplit(")", 1)[0]
            computations[current].append((name, hlo_type, opcode, re.findall(r"%([\w.-]+)", args), rest))
    return computations, entry


def trip_count(while_rest: str, condition: list) -> int:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_rest)
    if known:
        return int(known.group(1))
    bounds = [
        int(re.match(r"(\d+)", rest).group(1))
        for name, t, op, _, rest in condition
        if op == "constant" and re.match(r"s32\[\]", t) and re.match(r"\d+\)", rest)
    ]
    return bounds[0] if len(bounds) == 1 and any("direction=LT" in i[4] for i in condition) else 1


def callee(rest: str, key: str) -> str | None:
    m = re.search(key + r"=%([\w.-]+)", rest)
    return m.group(1) if m else None


def has_matmul(computations: dict, name: str) -> bool:
    for _, _, opcode, _, rest in computations.get(name, []):
        if opcode in ("dot", "convolution") or (opcode == "fusion" and has_matmul(computations, callee(rest, "calls"))):
            return True
    return False


def fusion_bytes(computations: dict, fused: str, operand_types: list, result_type: str) -> tuple[int, int]:
    """(HBM bytes read, HBM bytes written) of a fusion: a parameter read only through slices (or a gather)
    counts what they take; a parameter updated in place (operand 0 of a dynamic-update-slice) counts nothing, and the
    output it becomes counts the update's bytes."""
    body = computations[fused]
    types = {name: t for name, t, *_ in body}
    users = collections.defaultdict(list)
    for name, t, opcode, operands, _rest in body:
        for i, operand in enumerate(operands):
            users[operand].append((name, t, opcode, i, operands))
    read, updates = 0, {}
    for name, t, opcode, _, rest in body:
        if opcode != "parameter":
            continue
        index = int(re.match(r"(\d+)", rest).group(1))
        outer = operand_types[index] if index < len(operand_types) else t
        if array_bytes(outer) == 0:  # in VMEM
            continue
        uses = users[name]
        if uses and all(op in ("slice", "dynamic-slice", "gather") and i == 0 for _, _, op, i, _ in uses):
            read += sum(array_bytes(re.sub(r"S\(\d+\)", "", ut)) for _, ut, *_ in uses)
        elif uses and all(op == "dynamic-update-slice" and i == 0 for _, _, op, i, _ in uses):
            for user, _, _, _, operands in uses:
                updates[user] = array_bytes(re.sub(r"S\(\d+\)", "", types[operands[1]]))
        else:
            read += array_bytes(outer)
    written = array_bytes(result_type)
    for user, update in updates.items():  # the output buffer is the updated parameter: only the update is written
        written -= array_bytes(re.sub(r"S\(\d+\)", "", types[user])) - update
    return read, max(written, 0)


def classify(computations: dict, opcode: str, rest: str) -> str:
    if opcode in ("copy", "transpose"):
        return "copy/transpose"
    if opcode == "dynamic-update-slice":
        return "dynamic-update-slice"
    if opcode != "fusion":
        return "other " + opcode
    body = computations[callee(rest, "calls")]
    opcodes = {op for _, _, op, _, _ in body}
    if "dynamic-update-slice" in opcodes:
        return "dynamic-update-slice"
    if opcodes <= LAYOUT_OPS | {"constant", "broadcast", "convert", "multiply"} and (
        opcodes & {"copy", "transpose", "slice", "concatenate"}
    ):
        return "copy/transpose"
    if opcodes & {"reduce", "reduce-window"}:
        return "reduce fusion"
    if opcodes & {"dynamic-slice", "gather", "scatter"}:
        return "slice/gather/scatter"
    return "elementwise fusion"


def memory_bound_ops(text: str) -> tuple[list, dict]:
    """([(ms, HBM bytes, count per step, where, kind, name, type, op_name)], {async moves: bytes}) of the
    top-level operations other than matmuls and custom calls."""
    computations, entry = parse(text)
    found, moves = [], collections.Counter()
    loops = [rest for _, _, opcode, _, rest in computations[entry] if opcode == "while"]
    # a step without accumulation: the layers' forward loop, the loss, the backward loop, the optimizer
    phases = (
        {
            "entry": "entry: embedding",
            "loop 1": "layers forward",
            "entry after loop 1": "entry: loss",
            "loop 2": "layers backward",
            "entry after loop 2": "entry: optimizer",
        }
        if len(loops) == 2
        else {}
    )
    # (computation, times per step, where): the entry, then loop bodies (and called computations) inside it
    pending, loop_number = [(entry, 1, "entry")], 0
    while pending:
        computation, times, where = pending.pop(0)
        body = computations[computation]
        types = {name: t for name, t, *_ in body}
        loops_seen = 0
        for name, hlo_type, opcode, operands, rest in body:
            if opcode == "while":
                loop_number += 1
                loops_seen += 1
                trips = trip_count(rest, computations.get(callee(rest, "condition"), []))
                pending.append((callee(rest, "body"), times * trips, f"loop {loop_number}"))
                if not phases:
                    print(f"loop {loop_number}: {trips} trips")
                continue
            if opcode == "call":
                pending.append((callee(rest, "to_apply"), times, where))
                continue
            if opcode in ASYNC_MOVES:
                moves[where] += times * array_bytes(hlo_type.split("}, ")[0] + "}", hbm_only=False)
                continue
            if opcode in FREE or opcode in ("custom-call", "dot", "convolution"):
                continue
            fused = callee(rest, "calls") if opcode == "fusion" else None
            if fused and has_matmul(computations, fused):
                continue
            operand_types = [types.get(o, "") for o in operands]
            if fused:
                read, written = fusion_bytes(computations, fused, operand_types, hlo_type)
            else:
                read, written = sum(array_bytes(t) for t in operand_types), array_bytes(hlo_type)
            nbytes = (read + written) * times
            if nbytes == 0:
                continue
            op_name = re.search(r'op_name="([^"]*)"', rest)
            op_name = op_name.group(1) if op_name else ""
            label = where if computation != entry else f"entry after loop {loop_number}" if loops_seen else "entry"
            label = phases.get(label, label)
            found.append(
                (
                    nbytes / HBM_BYTES_PER_S * 1e3,
                    nbytes,
                    times,
                    label,
                    classify(computations, opcode, rest),
                    re.sub(r"\.clone.*$", "", name),
                    re.sub(r"\{[^}]*\}", "", hlo_type)[:70],
                    "/".join(op_name.split("/")[-2:]),
                )
            )
    return sorted(found, reverse=True), moves


def compile_for_v5e(flags: list[str]):
    import jax  # here: --hlo needs neither JAX nor libtpu
    from jax.experimental import topologies

    import configurator
    import sharding
    import train

    config = configurator.load_config(flags, complete=train.complete_config)
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[:1]  # one chip
    setup = train.make_setup(config, sharding.mesh_from_config(config, devices), config.vocab_size or 50257)
    print(f"attention: {setup.model_config.attention}, remat_policy: {config.remat_policy}, jax {jax.__version__}")
    return train.lower(setup).compile()


def main(argv: list[str]) -> None:
    options = dict(a[2:].split("=", 1) for a in argv if a.split("=")[0] in ("--top", "--hlo"))
    flags = [a for a in argv if a.split("=")[0] not in ("--top", "--hlo")]
    if "hlo" in options:
        with open(options["hlo"]) as f:
            text = f.read()
    else:
        compiled = compile_for_v5e(flags)
        text = compiled.as_text()
        with open("/tmp/tpu_train.hlo", "w") as f:
            f.write(text)
        m = compiled.memory_analysis()
        print(
            f"memory: arguments {m.argument_size_in_bytes / 2**20:,.1f} MiB, outputs {m.output_size_in_bytes / 2**20:,.1f}"
            f" MiB (aliased {m.alias_size_in_bytes / 2**20:,.1f}), temporaries {m.temp_size_in_bytes / 2**20:,.1f} MiB, "
            f"code {m.generated_code_size_in_bytes / 2**20:,.1f} MiB"
        )
    ops, moves = memory_bound_ops(text)
    top = int(options.get("top", 25))
    print(
        f"\nthe {top} largest of {len(ops)} memory-bound operations (HBM bytes read + written per step, "
        f"ms at {HBM_BYTES_PER_S / 1e9:.0f} GB/s):"
    )
    print(f"  {'ms':>6} {'MB':>8} {'x':>3}  {'where':22} {'kind':22} {'operation':38} {'result':40} from")
    for ms, nbytes, times, where, kind, name, hlo_type, op_name in ops[:top]:
        print(
            f"  {ms:6.2f} {nbytes / 1e6:8.1f} {times:3d}  {where:22} {kind:22} {name[:38]:38} {hlo_type[:40]:40} {op_name}"
        )
    for title, key in (("where", 3), ("kind", 4)):
        totals = collections.defaultdict(lambda: [0.0, 0])
        for op in ops:
            totals[op[key]][0] += op[0]
            totals[op[key]][1] += op[1]
        print(f"\nby {title}:")
        for group, (ms, nbytes) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            if ms >= 0.005:
                print(f"  {ms:7.2f} ms {nbytes / 1e9:7.2f} GB  {group}")
    print(
        f"\ntotal: {sum(op[0] for op in ops):.2f} ms, {sum(op[1] for op in ops) / 1e9:.2f} GB in "
        f"{sum(op[2] for op in ops)} operation runs per step"
    )
    print(
        "asynchronous HBM <-> VMEM copies (overlapped): "
        + ", ".join(f"{where} {nbytes / 1e9:.2f} GB" for where, nbytes in moves.items())
    )


if __name__ == "__main__":
    main(sys.argv[1:])
