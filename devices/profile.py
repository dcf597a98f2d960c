"""Where a compiled step's time goes, read from the trace jax.profiler writes (the .xplane.pb under
<dir>/plugins/profile/<run>/, read with jax.profiler.ProfileData: no dependency beyond JAX).

Every operation the trace recorded falls in one of three kinds, by what the compiled program (its
optimized HLO text) says it is:
  matmul     a dot or convolution, or a fusion whose computation holds one (XLA fuses the elementwise
             work around a matmul into it; its time is the matmul's). FLOPs: 2 x the output's elements
             x the contracted elements of each dot (XLA:TPU writes dots as convolutions: the input
             features times the kernel's taps that land on the input), read from the HLO's shapes and
             counted at every run of the operation (a layer loop's body n_layer times).
  attention  a kernel called by the program: Pallas's (custom_call_target tpu_custom_call: splash
             attention's forward and backward on a TPU) or cuDNN's attention. Where attention is
             written out (CPUs, --attention=einsum/xla) its matmuls are matmuls and its softmax other.
  other      everything else: elementwise and reduction fusions, copies, loops' own bookkeeping, XLA's
             own custom calls.
Time is wall-clock: from the first operation's start to the last one's end, every moment counts once,
for the first kind of matmul, attention, other that runs then (a CPU runs operations on several threads
at once; a TPU core runs one at a time), and a moment with none running is idle (the host's dispatch,
the wait between steps). The four add up to the traced time.
"""

import glob
import os
import re

import jax

KINDS = ("matmul", "attention", "other")


def newest_trace(directory: str) -> str:
    """The xplane file jax.profiler.trace just wrote under directory (one folder per trace)."""
    traces = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.xplane.pb")), key=os.path.getmtime)
    if not traces:
        raise ValueError(f"--profile={directory}: the profiler wrote no trace there")
    return traces[-1]


def operation_lines(profile) -> list[list]:
    """The compiled program's operations in a jax.profiler.ProfileData (which must outlive them), as its
    events, line by line (a line's events run one after another or nested): a GPU's or TPU's 'XLA Ops'
    lines, or on a CPU each host thread's events that name an HLO operation."""
    lines = [
        (plane.name, line.name, list(line.events)) for plane in profile.planes for line in plane.lines
    ]  # one pass each
    device_lines = [events for plane, line, events in lines if plane.startswith("/device:") and line == "XLA Ops"]
    if device_lines:
        return device_lines
    return [[event for event in events if any(key == "hlo_op" for key, _ in event.stats)] for _, _, events in lines]


def operation_name(event_name: str) -> str:
    """The HLO instruction's name: a CPU's trace calls the event by it ('fusion.3'), a TPU's by the
    instruction's whole text ('%fusion.3 = bf16[...] fusion(...), ...')."""
    return event_name.split(" = ", 1)[0].removeprefix("%") if " = " in event_name else event_name


INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
COMPUTATION = re.compile(r"(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")


def dims_of(hlo_type: str) -> list[int]:
    """The dimensions of an array type ('bf16[16,1024,768]{2,1,0:T(8,128)}' -> [16, 1024, 768]); [] for
    a scalar or a tuple."""
    match = re.match(r"[a-z0-9]+\[([0-9,]*)\]", hlo_type)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def product(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def matmul_flops(kind: str, shape: str, rest: str, shapes: dict[str, str]) -> int:
    """FLOPs of one dot or convolution instruction, from its output's and operands' shapes: 2 per
    multiply-add that reads no padding."""
    operands = re.findall(r"%([\w.\-]+)", rest)[:2]  # the first two names (attributes come after)
    if len(operands) < 2 or operands[0] not in shapes or operands[1] not in shapes:
        return 0
    lhs, rhs, out = dims_of(shapes[operands[0]]), dims_of(shapes[operands[1]]), dims_of(shape)
    if kind == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
        return (
            2
            * product(out)
            * (product(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1)
        )
    return convolution_flops(lhs, rhs, out, rest)


def convolution_flops(lhs: list[int], rhs: list[int], out: list[int], rest: str) -> int:
    """A TPU's compiler writes dots as convolutions, a batch dimension sometimes as a window that slides
    over padding (window={size=16x1 pad=15_15x0_0}): each output element counts the kernel's taps
    that land on the input, times the input features."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not labels or [len(labels.group(i)) for i in (1, 2, 3)] != [len(lhs), len(rhs), len(out)]:
        return 0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    spatial = sorted(c for c in out_labels if c.isdigit())
    window = re.search(r"window=\{([^}]*)\}", rest)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
    if any(key in fields for key in ("lhs_dilate", "rhs_dilate")):
        return 0  # not a dot in disguise; not counted
    size = fields.get("size", "x".join(str(rhs[rhs_labels.index(d)]) for d in spatial)).split("x")
    pad = fields.get("pad", "x".join("0_0" for _ in spatial)).split("x")
    stride = fields.get("stride", "x".join("1" for _ in spatial)).split("x")
    taps = 1  # over all spatial dimensions: (output position, kernel tap) pairs on the input
    for i, d in enumerate(spatial):
        low, n_in, n_out = int(pad[i].split("_")[0]), lhs[lhs_labels.index(d)], out[out_labels.index(d)]
        taps *= sum(
            sum(1 for k in range(int(size[i])) if 0 <= o * int(stride[i]) + k - low < n_in) for o in range(n_out)
        )
    batch, features = out[out_labels.index("b")], out[out_labels.index("f")]
    return 2 * batch * features * rhs[rhs_labels.index("i")] * taps


def classify_operations(hlo_text: str) -> dict[str, tuple[str, int, str]]:
    """{instruction name: (kind, matmul FLOPs per run, custom call's kernel)} of a compiled program's HLO
    text, for every instruction (names are unique in a module, as the trace names them)."""
    shapes, computations, current = {}, {}, None  # computation -> its instructions (name, kind, shape, rest)
    for line in hlo_text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            name, shape, kind, rest = match.groups()
            shapes[name] = shape
            current.append((name, kind, shape, rest))

    flops_of = {}  # computation -> the FLOPs of the dots in it and in what it calls (fusions nest)

    def computation_flops(computation: str, seen=()) -> int:
        if computation not in flops_of:
            total = 0
            for _, kind, shape, rest in computations.get(computation, []):
                total += instruction_flops(kind, shape, rest, seen + (computation,))
            flops_of[computation] = total
        return flops_of[computation]

    def instruction_flops(kind: str, shape: str, rest: str, seen) -> int:
        if kind in ("dot", "convolution"):
            return matmul_flops(kind, shape, rest, shapes)
        if kind in ("fusion", "call"):
            called = re.search(r"(?:calls|to_apply)=%?([\w.\-]+)", rest)
            if called and called.group(1) not in seen:
                return computation_flops(called.group(1), seen)
        return 0

    described = {}
    for instructions in computations.values():
        for name, kind, shape, rest in instructions:
            flops = instruction_flops(kind, shape, rest, ())
            target = re.search(r'custom_call_target="([^"]*)"', rest) if kind == "custom-call" else None
            if target and target.group(1) == "tpu_custom_call":  # a Pallas kernel: splash_mha_fwd_residuals.6
                described[name] = ("attention", 0, re.sub(r"\.\d+$", "", name))
            elif target and "fmha" in target.group(1):  # cuDNN's attention on a GPU
                described[name] = ("attention", 0, target.group(1))
            else:  # XLA's own custom calls (AllocateBuffer, ConcatBitcast, ...) are bookkeeping
                described[name] = ("matmul" if flops else "other", flops, "")
    return described


def step_summary(trace: str, steps: int, hlo_text: str) -> dict:
    """Per step: the wall-clock ms in matmuls, attention kernels, other operations and idle (they add up
    to the traced time per step), the matmuls' FLOPs and achieved FLOP/s, the custom calls' kernels."""
    described = classify_operations(hlo_text)
    profile = jax.profiler.ProfileData.from_file(trace)
    edges, flops, kernels, unknown = [], 0, set(), set()  # edges: (time, +1 start / -1 end, kind)
    for line in operation_lines(profile):
        for event in line:
            name = operation_name(event.name)
            kind, op_flops, kernel = described.get(name, ("other", 0, ""))
            if name not in described:
                unknown.add(name)
            flops += op_flops
            if kernel:
                kernels.add(kernel)
            edges += [(event.start_ns, 1, kind), (event.start_ns + event.duration_ns, -1, kind)]
    if not edges:
        raise ValueError(f"{trace}: the trace holds no operation of the compiled step")
    edges.sort(key=lambda e: (e[0], e[1]))  # at one instant, ends before starts
    ns = dict.fromkeys(KINDS + ("idle",), 0.0)
    running = dict.fromkeys(KINDS, 0)
    for (time, delta, kind), (next_time, _, _) in zip(edges, edges[1:] + [edges[-1]]):
        running[kind] += delta
        first = next((k for k in KINDS if running[k] > 0), "idle")
        ns[first] += next_time - time
    traced_ns = edges[-1][0] - edges[0][0]
    return {
        "steps": steps,
        "ms_per_step": traced_ns / steps / 1e6,
        **{f"{kind}_ms": ns[kind] / steps / 1e6 for kind in ns},
        "matmul_flops_per_step": flops / steps,
        "matmul_flops_per_s": flops / (ns["matmul"] / 1e9) if ns["matmul"] else None,
        "kernels": sorted(kernels),
        "operations_not_in_the_program": len(unknown),
    }


def format_step_summary(s: dict, model_flops_per_step: float, peak: float | None, platform: str) -> list[str]:
    """The summary's lines: each kind's ms per step and share of it, the matmuls' FLOPs and rate, and
    how long the model's FLOPs would take at the peak (the distance to the matmul ceiling)."""
    share = lambda ms: f"{ms:9.2f} ms {ms / s['ms_per_step']:6.1%}"
    rate, flops = s["matmul_flops_per_s"], s["matmul_flops_per_step"]
    matmul = (
        f"{rate / 1e12:,.2f} TFLOP/s" + (f" = {rate / peak:.1%} of the measured peak" if peak else "")
        if rate
        else "none ran"
    )
    attention = (
        "kernels (custom calls): " + ", ".join(s["kernels"])
        if s["kernels"]
        else f"no kernel on this {platform}: attention written out, its matmuls in the row above"
    )
    lines = [
        f"  where a step goes ({s['steps']} traced steps, {s['ms_per_step']:,.2f} ms per step from the first "
        f"operation's start to the last's end):",
        f"    matmuls     {share(s['matmul_ms'])}  {matmul}; {flops / 1e9:,.2f} GFLOP (the HLO's dot/convolution "
        f"shapes) = {flops / model_flops_per_step:.2f} x the model's"
        + (", the kernels' not in it" if s["kernels"] else ""),
        f"    attention   {share(s['attention_ms'])}  {attention}",
        f"    other       {share(s['other_ms'])}  elementwise, reductions, copies, loops' bookkeeping",
        f"    idle        {share(s['idle_ms'])}  no operation running: the host's dispatch, the wait between steps",
    ]
    if s["operations_not_in_the_program"]:
        lines.append(
            f"    ({s['operations_not_in_the_program']} operations of the trace are not in the program: in other)"
        )
    if peak:
        lines.append(
            f"    the model's FLOPs take {model_flops_per_step / peak * 1e3:,.2f} ms at the measured peak"
            + (f", {model_flops_per_step / rate * 1e3:,.2f} ms at the matmuls' rate" if rate else "")
        )
    return lines
